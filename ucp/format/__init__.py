"""The on-disk format's models: manifest, state tree, dtypes, sharding boxes, regions."""
