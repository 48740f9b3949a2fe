"""How specd starts: one machine (local processes + embedded Ray), or a Ray cluster."""
