"""Writing a dataset: input readers, the two passes over the cells, obs, tiles, the AnnData
elements, spatial order and the atomic switch into place."""
