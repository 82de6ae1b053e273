"""The models: the open_clip dual encoder, pretrained towers, the temperature policy."""
