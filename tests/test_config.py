import pytest

from jaxllm.config import (ATTENTION_IMPLS, MATMUL_IMPLS, ConfigError, RopeScaling,
                           SpeculativeConfig, load_config, save_config)


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


LLAMA3 = ["model.rope_scaling.rope_type=llama3", "model.rope_scaling.factor=8",
          "model.rope_scaling.low_freq_factor=1", "model.rope_scaling.high_freq_factor=4",
          "model.rope_scaling.original_max_position_embeddings=8192"]


def test_nested_sections_from_yaml_and_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model:\n  mtp_depth: 2\n  rope_scaling: {rope_type: llama3, factor: 8,"
                    " low_freq_factor: 1, high_freq_factor: 4,"
                    " original_max_position_embeddings: 8192}\n"
                    "inference:\n  speculative:\n    method: mtp\n")
    cfg = load_config(path, ["inference.speculative.k=1", "model.rope_scaling.factor=16"])
    assert cfg.model.rope_scaling == RopeScaling("llama3", 16.0, 1.0, 4.0, 8192)
    assert cfg.inference.speculative == SpeculativeConfig("mtp", k=1)
    assert load_config(path).inference.speculative.resolved_k(cfg.model.mtp_depth) == 2
    assert load_config(path, ["model.rope_scaling=null"]).model.rope_scaling is None
    assert load_config(None, LLAMA3).model.rope_scaling.factor == 8.0


@pytest.mark.parametrize("override,match", [
    ("inference.speculative.kk=2", r"inference.speculative.kk; did you mean 'k'"),
    ("model.rope_scaling.factr=8", r"model.rope_scaling.factr; did you mean 'factor'"),
    ("model.rope_scaling.factor=x", "expected float"),
    ("model.remat=ful", r"model.remat='ful' is unknown.*\('none', 'full', 'dots'\); "
                        r"did you mean 'full'"),
    ("inference.matmul_impl=triton", r"choose one of \('auto', 'xla', 'pallas_triton'\)"),
    ("parallelism.cp_impl=1", "parallelism.cp_impl=1 is unknown"),
    ("inference.unstack_layers=true", "was removed"),
])
def test_nested_and_literal_errors(override, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, [override])


def test_nested_section_checks():
    with pytest.raises(ConfigError, match="lacks low_freq_factor"):
        load_config(None, LLAMA3[:2])  # a nested section without defaults needs every key
    with pytest.raises(ConfigError, match="high_freq_factor=1.0 must exceed"):
        load_config(None, LLAMA3 + ["model.rope_scaling.high_freq_factor=1"])


def test_save_load_round_trip_and_hash(tmp_path):
    cfg = load_config(None, LLAMA3 + ["model.mtp_depth=3", "inference.speculative.method=mtp",
                                      "inference.speculative.k=2"])
    save_config(cfg, tmp_path / "config.yaml")
    assert load_config(tmp_path) == cfg
    assert load_config(tmp_path, ["model.rope_scaling=null"]) != cfg
    assert hash(cfg.model) == hash(load_config(tmp_path).model)  # static metadata of models
    assert MATMUL_IMPLS == ("auto", "xla", "pallas_triton") and "pallas_mosaic" in ATTENTION_IMPLS
