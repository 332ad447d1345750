"""The one error every part of the jail raises when it cannot hold."""


class SandboxUnavailable(RuntimeError):
    """The jail cannot be built as specified here (bwrap, its user, seccomp or cgroups missing):
    user code is never run outside it, nor inside a weaker one."""
