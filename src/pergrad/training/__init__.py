"""Training: :class:`~pergrad.training.model.PerExampleModel` (the Keras model wrapper), the
backends' trainer glue (``trainers``) and the single-device train step (``step``)."""
