"""Math only: layers, the MoE block, the decoder (families differ by ModelConfig flags); and as plain data, the
family table (families.py) and the canonical tensor names (names.py) that loaders and the model share."""
