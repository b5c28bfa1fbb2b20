"""annbatch's side of bench_loader.py, run by the Python of annbatch's own virtualenv.

    python _annbatch_child.py --child '{"tool": "annbatch", "path": ..., "batch_size": ...,
                                        "options": {"convert_to": ...}}'

With ``convert_to``: make a shuffled annbatch collection from the h5ad at ``path``. Otherwise
time one epoch over the collection at ``path`` with the README's settings and the zarrs
pipeline, X only (as the deltacells run), or over its first ``max_batches`` batches, then
``epochs - 1`` more epochs in the same process (timed apart), and print the result as JSON.
"""

from __future__ import annotations

import json
import sys
import time

import anndata as ad
import zarr
from annbatch import DatasetCollection, Loader

zarr.config.set({"codec_pipeline.path": "zarrs.ZarrsCodecPipeline"})


def main(spec: dict) -> None:
    options = spec["options"]
    if "convert_to" in options:
        DatasetCollection(options["convert_to"]).add_adatas([spec["path"]], shuffle=True)
        print(json.dumps({"cells": 0, "seconds": 1.0}))
        return
    if "storage_options" in options:  # through S3: a zarr group on an fsspec store
        group = zarr.open_group(spec["path"], mode="r", storage_options=options["storage_options"])
        collection = DatasetCollection(group)
    else:
        collection = DatasetCollection(spec["path"], mode="r")
    with ad.settings.override(remove_unused_categories=False):
        loader = Loader(batch_size=spec["batch_size"], chunk_size=32, preload_nchunks=256,
                        shuffle=True, preload_to_gpu=False)  # fmt: skip
        loader = loader.use_collection(
            collection, load_adata=lambda g: ad.AnnData(X=ad.io.sparse_dataset(g["X"]))
        )
        max_batches = options.get("max_batches")
        times, counts = [], []
        for _ in range(options.get("epochs", 1)):  # each pass over the loader is an epoch
            t0 = time.perf_counter()
            cells = 0
            for i, batch in enumerate(loader):
                if max_batches is not None and i >= max_batches:
                    break
                cells += batch["X"].shape[0]
            times.append(time.perf_counter() - t0)
            counts.append(cells)
        if len(set(counts)) != 1:
            raise RuntimeError(f"epochs gave different numbers of cells: {counts}")
    # VmHWM: this process's own peak (ru_maxrss would carry the parent's across exec).
    peak = next(int(line.split()[1]) / 1024 for line in open("/proc/self/status")
                if line.startswith("VmHWM:"))  # fmt: skip
    print(json.dumps({"cells": cells, "seconds": times[0], "later_seconds": times[1:],
                      "peak_rss_mb": peak}))


if __name__ == "__main__":
    main(json.loads(sys.argv[2]))
