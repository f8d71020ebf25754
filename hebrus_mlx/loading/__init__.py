"""Load layer: build the MLX graph from an admitted artifact and attach streaming (format ->
admission -> load -> generate). `plan` decides resident vs streamed without MLX."""
