"""The package's version (also in pyproject.toml), apart so the core can read it without
importing the package."""

__version__ = "0.1.0"
