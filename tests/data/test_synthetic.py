from vlp.data.sources import synthetic


def test_synthetic_is_deterministic_and_captioned():
    a = synthetic.load_pairs(5, image_size=32, seed=1)
    b = synthetic.load_pairs(5, image_size=32, seed=1, image_format="PNG")
    assert [(p.key, p.caption, p.image) for p in a] == [(p.key, p.caption, p.image) for p in b]
    assert all(p.meta["shape"] in p.caption for p in a)
