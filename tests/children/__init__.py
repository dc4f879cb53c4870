"""Checks that run as child processes (``cpu_devices.run_child``): the device count must be set before JAX
starts, and the rest of the suite runs on one device. Each module is run as ``python -m children.<name>``
with ``tests/`` on the path, and prints ``OK`` when its checks pass."""
