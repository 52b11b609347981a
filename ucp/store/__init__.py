"""Where bytes live: storage backends, the data-file reader and writer, the atomic commit."""
