"""Contrastive losses with one call signature, each returning ``(loss, metrics)``.

    loss, metrics = get_loss(name)(img_local, txt_local, img_global, txt_global, logit_scale,
                                   logit_bias=None, offset=o, scale_grad="same")

img_local/txt_local (b, d) this rank's L2-normalised features; img_global/txt_global (B, d) the
gathered ones (vlp.distributed.gather_with_grad); logit_scale t already exponentiated; offset o the
global column of local row 0's positive (vlp.distributed.positive_offset). ``loss`` is the mean over
this rank's anchors (see vlp/distributed.py for why that is the right scale under DDP); ``metrics``
holds "loss" plus the diagnostics of vlp.losses.diagnostics as Python floats.

The names, and what each loss needs, are vlp.losses.registry's (the one source: get_loss,
get_spec), the temperature policy a loss section decides vlp.losses.temperature's; each loss is
defined in its own module (vlp.losses.infonce, .flatnce, .dcl, .siglip, .sogclr, .fastclip,
.isogclr). Neither loads torch at import: vlp.experiment checks configs with them before any
work. Import from the module that defines a name.
"""
