from django.apps import AppConfig


class RegistryConfig(AppConfig):
    name = "webapp.registry"
    label = "registry"
