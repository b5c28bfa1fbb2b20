"""Type stubs for _pools.pyx: it has no Python-level names; its pools are shared with the
other kernel modules through _pools.pxd."""
