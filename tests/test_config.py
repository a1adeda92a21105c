import pytest

from jaxllm.config import ConfigError, load_config, save_config


def test_defaults_and_overrides(tmp_path):
    cfg = load_config("configs/tiny.yaml", ["model.n_layers=2", "train.lr=1e-3",
                                            "model.attention_impl=xla"])
    assert cfg.model.n_layers == 2 and cfg.train.lr == 1e-3 and cfg.model.attention_impl == "xla"
    save_config(cfg, tmp_path / "config.yaml")
    assert load_config(tmp_path / "config.yaml") == cfg
    assert load_config(tmp_path) == cfg  # a run directory


@pytest.mark.parametrize("override,match", [
    ("model.n_layer=2", "did you mean 'n_layers'"),
    ("modle.n_layers=2", "did you mean 'model'"),
    ("model.n_layers=two", "expected int"),
    ("model.d_model=0", "must be positive"),
    ("model.n_heads=5", "not divisible by model.n_kv_heads"),
    ("model.d_model=130", "not divisible by model.n_heads"),
    ("model.dtype=fp8", "not a known dtype"),
    ("model.attention_impl=fast", "is unknown"),
    ("train.batch_size=-1", "must be positive"),
    ("train.zero_stage=4", "zero_stage"),
    ("inference.top_p=0", "top_p"),
    ("parallelism.tp=0", "parallelism.tp"),
    ("train.tie=yes", "valid keys|did you mean"),
    ("nodots", "section.key=value"),
])
def test_config_errors(override, match):
    with pytest.raises(ConfigError, match=match):
        load_config("configs/tiny.yaml", [override])


def test_missing_file():
    with pytest.raises(ConfigError, match="does not exist"):
        load_config("configs/nope.yaml")


def test_bool_is_not_int():
    with pytest.raises(ConfigError, match="expected int"):
        load_config(None, ["model.n_layers=true"])
