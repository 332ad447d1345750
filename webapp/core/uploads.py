"""Request bodies are read with their size cap enforced while reading, never after.

- Files (multipart): :class:`CappedUploadHandler` is first in ``FILE_UPLOAD_HANDLERS``. It stops
  the parse as soon as the bytes of the request's files pass ``DATASET_MAX_UPLOAD_BYTES`` (at the
  first chunk when the declared Content-Length is already over), so a 1 GB stream costs one chunk
  of memory and no disk. The view then answers 413 through :func:`upload_check`.
- JSON and form bodies: Django refuses a declared length over ``DATA_UPLOAD_MAX_MEMORY_SIZE``
  before reading (``RequestDataTooBig``; the API answers 413, see webapp.api.errors), and its
  WSGI request never reads past the declared length.
"""

from __future__ import annotations

from django.conf import settings
from django.core.files.uploadhandler import FileUploadHandler, StopUpload
from django.http import HttpRequest

from webapp.core.errors import ApplicationError

MULTIPART_OVERHEAD = 64 * 1024  # the other form fields and part headers around the file


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


class CappedUploadHandler(FileUploadHandler):
    def handle_raw_input(self, input_data, META, content_length, boundary, encoding=None):
        self.limit = settings.DATASET_MAX_UPLOAD_BYTES
        self.received = 0
        self.over = content_length > self.limit + MULTIPART_OVERHEAD
        self.request.upload_too_large = False

    def new_file(self, *args, **kwargs) -> None:
        super().new_file(*args, **kwargs)
        if self.over:  # the fields before the file (the CSRF token) are already parsed
            self._refuse()

    def receive_data_chunk(self, raw_data: bytes, start: int) -> bytes:
        self.received += len(raw_data)
        if self.received > self.limit:
            self._refuse()
        return raw_data

    def file_complete(self, file_size: int) -> None:
        return None  # the next handler in the chain stores the file

    def _refuse(self) -> None:
        self.request.upload_too_large = True
        raise StopUpload(connection_reset=True)  # do not read (or store) the rest


def upload_check(request: HttpRequest) -> None:
    """Raise the 413 for a request whose files went over the cap (call after parsing)."""
    request = getattr(request, "_request", request)  # a DRF request wraps Django's
    if getattr(request, "upload_too_large", False):
        raise ApplicationError(
            f"the upload is over the limit of {_mb(settings.DATASET_MAX_UPLOAD_BYTES)} "
            "(OOLONG_DATASET_MAX_UPLOAD_MB); nothing was stored", field="file", status_code=413)
