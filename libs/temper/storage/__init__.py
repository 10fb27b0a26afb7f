"""Object storage: one interface, a local directory and an S3 server behind it.

Keys are plain strings with ``/`` separators; :func:`object_key` namespaces them
per tenant and job so that two tenants never share a prefix.
"""

from temper.storage.base import NotFound, ObjectStore, object_key
from temper.storage.factory import make_store
from temper.storage.local import LocalStore
from temper.storage.s3 import S3Store

__all__ = ["LocalStore", "NotFound", "ObjectStore", "S3Store", "make_store", "object_key"]
