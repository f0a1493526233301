"""Math only: layers, the MoE block, the decoder (families differ by ModelConfig flags)."""
