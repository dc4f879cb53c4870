"""A Google Cloud Storage emulator for tests (``gcp-storage-emulator``, in this process, on 127.0.0.1), and
the environment that points the GCS clients at it: gcsfs / google-cloud-storage read
``STORAGE_EMULATOR_HOST``, tensorstore (orbax's array writer) ``TENSORSTORE_GCS_HTTP_URL``;
``GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false`` spares each bucket's first use a 60 s gRPC probe the emulator
cannot answer.

The emulator ignores upload preconditions; GCS answers an upload whose ``ifGenerationMatch`` does not
match the object's generation (0: the object exists) with HTTP 412. :func:`gcs_emulator` adds that rule
to its uploads of run-lock objects (``*/train.lock``), so the lock's generation-checked writes are tested
as GCS runs them. Not to every object: tensorstore's OCDBT writes then hit real conflicts, whose recovery
reads the object's generation from response headers this emulator does not send."""

from __future__ import annotations

import contextlib
import os

from cpu_devices import free_port

BUCKET = "bkt"
LOCK_OBJECT = "/train.lock"




def _with_generation_header(download):
    """GCS sends an object's generation with its content (``x-goog-generation``); tensorstore reads it."""
    from gcp_storage_emulator.exceptions import NotFound

    def with_header(request, response, storage, *args, **kwargs):
        try:
            obj = storage.get_file_obj(request.params["bucket_name"], request.params["object_id"])
            response["x-goog-generation"] = str(obj.get("generation") or 0)
            response["x-goog-metageneration"] = str(obj.get("metageneration") or 1)
        except NotFound:
            pass
        return download(request, response, storage, *args, **kwargs)

    return with_header


def _with_generation_precondition(upload):
    from http import HTTPStatus

    from gcp_storage_emulator.exceptions import NotFound

    def checked(request, response, storage):
        want = request.query.get("ifGenerationMatch")
        name = request.query["name"][0] if "name" in request.query else request.data["meta"].get("name")
        if want and name.endswith(LOCK_OBJECT):
            try:
                have = int(storage.get_file_obj(request.params["bucket_name"], name).get("generation") or 0)
            except NotFound:
                have = 0
            if have != int(want[0]):
                response.status = HTTPStatus.PRECONDITION_FAILED
                return None
        return upload(request, response, storage)

    return checked


@contextlib.contextmanager
def gcs_emulator():
    """Start an in-memory emulator holding bucket :data:`BUCKET`; yields the environment variables that
    point clients at it (also set in ``os.environ`` while the block runs)."""
    from gcp_storage_emulator import server as emulator
    from gcp_storage_emulator.handlers import objects

    saved = objects._multipart_upload, objects._media_upload, objects.download
    objects._multipart_upload, objects._media_upload = map(_with_generation_precondition, saved[:2])
    objects.download = _with_generation_header(saved[2])
    routes = [methods for _, methods in emulator.HANDLERS if methods.get(emulator.GET) is saved[2]]
    for methods in routes:
        methods[emulator.GET] = objects.download
    port = free_port()
    server = emulator.create_server("127.0.0.1", port, in_memory=True, default_bucket=BUCKET)
    server.start()
    url = f"http://127.0.0.1:{port}"
    env = {"STORAGE_EMULATOR_HOST": url, "TENSORSTORE_GCS_HTTP_URL": url, "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}
    before = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    import fsspec

    fsspec.filesystem("gcs").clear_instance_cache()  # a gcsfs instance made for another emulator is stale
    try:
        yield env
    finally:
        server.stop()
        objects._multipart_upload, objects._media_upload, objects.download = saved
        for methods in routes:
            methods[emulator.GET] = saved[2]
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
