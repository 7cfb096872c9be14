"""turnrl: RL for multi-turn, tool-using language-model agents."""
