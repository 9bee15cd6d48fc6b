"""--kv-transfer-config as vLLM writes it: OffloadingConnector is the host KV tier (its
cpu_bytes_to_use its size); vLLM's transport keys parse; what folio does not have is an
error naming the field."""
from __future__ import annotations

import pytest

from folio.config import KVTransferConfig, offloading_size

OFFLOAD = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
           "kv_connector_extra_config": {"cpu_bytes_to_use": 2 << 30, "block_size": 16}}


def test_offloading_connector_is_the_host_tier() -> None:
    import json
    assert offloading_size(None, OFFLOAD) == 2.0
    assert offloading_size(None, json.dumps({**OFFLOAD, "kv_buffer_device": "cuda"})) == 2.0
    assert offloading_size(1.5, None) == 1.5 and offloading_size(None, None) is None
    config = KVTransferConfig.from_json(OFFLOAD)
    assert config.offloading_size_gib() == 2.0


@pytest.mark.parametrize("change, field", [
    ({"kv_connector": "LMCacheConnectorV1"}, "kv_transfer_config.kv_connector"),
    ({"kv_role": "kv_producer"}, "kv_transfer_config.kv_role"),
    ({"kv_role": "both"}, "kv_transfer_config.kv_role"),
    ({"kv_connector_extra_config": {}}, "cpu_bytes_to_use"),
    ({"kv_connector_extra_config": {"cpu_bytes_to_use": 1, "num_cpu_blocks": 8}},
     "kv_connector_extra_config"),
    ({"kv_connector_extra_config": {"cpu_bytes_to_use": 1, "spec_name": "TieringOffloadingSpec"}},
     "spec_name"),
    ({"kv_cache_backend": "x"}, "unknown keys"),
])
def test_what_folio_does_not_have_is_a_clear_error(change, field) -> None:
    with pytest.raises(ValueError, match=field):
        KVTransferConfig.from_json({**OFFLOAD, **change})


def test_one_way_to_size_the_tier() -> None:
    with pytest.raises(ValueError, match="not both"):
        offloading_size(1.0, OFFLOAD)
    with pytest.raises(ValueError, match="valid JSON"):
        offloading_size(None, "{nope")


def test_vllm_p2p_connector_names_run_folios_p2p_connector() -> None:
    """A disaggregated-prefill config written for vLLM (P2pNcclConnector, NixlConnector) runs
    folio's P2pConnector; vLLM's own transport settings are kept aside, unused."""
    config = KVTransferConfig.from_json({
        "kv_connector": "P2pNcclConnector", "kv_role": "kv_producer", "kv_port": 21001,
        "kv_connector_extra_config": {"proxy_ip": "127.0.0.1", "send_type": "PUT_ASYNC"}})
    assert (config.kv_connector, config.alias_of, config.kv_port) == \
        ("P2pConnector", "P2pNcclConnector", 21001)
    assert config.is_producer and not config.is_consumer
    assert config.unused == {"kv_connector_extra_config.proxy_ip": "127.0.0.1",
                             "kv_connector_extra_config.send_type": "PUT_ASYNC"}
    nixl = KVTransferConfig.from_json({"kv_connector": "NixlConnector", "kv_role": "kv_both"})
    assert nixl.kv_connector == "P2pConnector" and nixl.is_producer and nixl.is_consumer
