"""A dataset's bytes: storage backends, the manifest, integrity checks of every stored file,
ranged tile reads and the AnnData elements stored beside the tiles."""
