"""Math only: the blocks a family's decoder is built from (attention kinds, the DeltaNet mixer, the router, the MoE
block, the residual; models/blocks.py builds them as arch/blocks.py's choices say) and the decoder itself
(transformer.py). The family table and the tensor names are arch/'s."""
