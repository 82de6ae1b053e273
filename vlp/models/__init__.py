"""The models: the open_clip dual encoder, pretrained towers, cached stems, packaged towers."""
