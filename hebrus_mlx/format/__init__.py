"""The model's format, free of MLX: its config dataclass (ModelArgs and the PLE constants derived from
it) and the checkpoint key tables. The artifact format (artifact/), admission and the converters read
these; the graph (models/) builds on them."""
