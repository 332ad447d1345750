"""Serializer fields shared by the APIs."""

from __future__ import annotations

from rest_framework import serializers
from rest_framework.fields import empty


class BoundedText(serializers.CharField):
    """Text trimmed of surrounding whitespace whose ``max_length`` holds for what the client sent,
    as the OpenAPI schema states it (DRF checks the length after trimming)."""

    def run_validation(self, data=empty):
        if isinstance(data, str) and self.max_length is not None and len(data) > self.max_length:
            self.fail("max_length", max_length=self.max_length)
        return super().run_validation(data)
