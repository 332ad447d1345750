"""Django REST framework and the OpenAPI schema."""

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "webapp.accounts.auth.UserTokenAuthentication",
        "rest_framework.authentication.SessionAuthentication",
    ],
    # JSON bodies (the upload endpoint takes multipart itself): one request format to document.
    "DEFAULT_PARSER_CLASSES": ["webapp.core.parsers.BoundedJSONParser"],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
    "DEFAULT_PAGINATION_CLASS": "rest_framework.pagination.LimitOffsetPagination",
    "PAGE_SIZE": 50,
    "DEFAULT_FILTER_BACKENDS": ["django_filters.rest_framework.DjangoFilterBackend"],
    "DEFAULT_SCHEMA_CLASS": "webapp.core.schema.AutoSchema",
    "EXCEPTION_HANDLER": "webapp.api.errors.exception_handler",
}

SPECTACULAR_SETTINGS = {
    "TITLE": "Oolong API",
    "DESCRIPTION": "Datasets, reward functions, runs and the experiment tracker.",
    "VERSION": "0.1.0",
    "SERVE_INCLUDE_SCHEMA": False,
    # Swagger UI assets from the sidecar package: no CDN.
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "REDOC_DIST": "SIDECAR",
    "COMPONENT_SPLIT_REQUEST": True,
    "POSTPROCESSING_HOOKS": ["drf_spectacular.hooks.postprocess_schema_enums",
                             "webapp.core.schema.document_body_errors"],
}
