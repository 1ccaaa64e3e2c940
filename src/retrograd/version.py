"""The package's version: what a checkpoint records, `retrograd --version` and the run server
print. A leaf: the modules inside the package read it here, never from the package root."""

__version__ = "0.1.0"
