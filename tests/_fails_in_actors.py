"""A job module that imports on the driver and fails to import inside a Ray actor (a worker),
as code missing from a cluster's nodes does."""

import ray

if ray.is_initialized() and ray.get_runtime_context().get_actor_id():
    raise ImportError("this module cannot be imported on the workers (test)")

from tests.helpers import mlp  # noqa: E402

__all__ = ["mlp"]
