"""See ../__init__.py: the build-time stand-in for ``torch.utils``."""
