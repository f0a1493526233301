"""Where an expert's bytes live: the host store (pinned), the GPU tier, and the providers the MoE block asks."""
