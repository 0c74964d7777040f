"""Speech models: recognition, synthesis, voice activity."""
