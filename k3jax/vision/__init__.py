"""Native vision: the MoonViT tower, the projector, the image processor and the splice of image
features into the LM's token embeddings (``docs/design.md``, "Vision")."""
