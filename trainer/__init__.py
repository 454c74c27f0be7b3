"""Pure-PyTorch trainer: models, data, training loop and the parallel engines."""
