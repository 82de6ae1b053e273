"""Contrastive losses with one call signature, each returning ``(loss, metrics)``.

    loss, metrics = get_loss(name)(img_local, txt_local, img_global, txt_global, logit_scale,
                                   logit_bias=None, offset=o, scale_grad="same")

img_local/txt_local (b, d) this rank's L2-normalised features; img_global/txt_global (B, d) the
gathered ones (vlp.distributed.gather_with_grad); logit_scale t already exponentiated; offset o the
global column of local row 0's positive (vlp.distributed.positive_offset). ``loss`` is the mean over
this rank's anchors (docs/losses.md); ``metrics`` holds "loss" plus vlp.losses.diagnostics'.

The names, and what each loss needs, are vlp.losses.registry's; the temperature policy
vlp.losses.temperature's. Neither loads torch at import: vlp.experiment checks configs with them
before any work. Import from the module that defines a name.
"""
