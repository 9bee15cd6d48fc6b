"""--generation-config: the model's sampling defaults apply to requests that leave them unset."""
from __future__ import annotations

import json
import shutil

from folio.config import EngineConfig, ModelConfig
from folio.engine.frontend import default_sampling_params, load_model_info


def _model_with_generation_config(tmp_path, tiny_model_dir) -> str:
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir("llama"), model)
    (model / "generation_config.json").write_text(json.dumps(
        {"do_sample": True, "temperature": 0.6, "top_p": 0.9, "top_k": 20, "eos_token_id": [2, 7]}))
    return str(model)


def test_auto_reads_the_models_generation_config(tmp_path, tiny_model_dir):
    model = _model_with_generation_config(tmp_path, tiny_model_dir)
    info = load_model_info(EngineConfig(model=ModelConfig(model=model, max_model_len=128)))
    params = default_sampling_params(info)
    assert (params.temperature, params.top_p, params.top_k) == (0.6, 0.9, 20)
    assert 7 in info.eos_token_ids


def test_folio_ignores_it_and_a_directory_overrides(tmp_path, tiny_model_dir):
    model = _model_with_generation_config(tmp_path, tiny_model_dir)
    plain = load_model_info(EngineConfig(model=ModelConfig(model=model, max_model_len=128,
                                                           generation_config="folio")))
    assert default_sampling_params(plain).temperature == 1.0
    other = tmp_path / "other"
    other.mkdir()
    (other / "generation_config.json").write_text(json.dumps({"do_sample": True, "temperature": 0.3}))
    info = load_model_info(EngineConfig(model=ModelConfig(model=model, max_model_len=128,
                                                          generation_config=str(other))))
    assert default_sampling_params(info).temperature == 0.3
