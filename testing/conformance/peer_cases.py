"""The test cases of Flax's and Equinox's own suites that the conformance tests port.

Neither library installs its tests, so their case names are listed here, each
list taken from the peer's public repository at the version the test
environment pins (`requirements.txt`):

    git -C flax show v0.12.7:tests/nnx/bridge/module_test.py | grep -o "def test_\\w*"
    git -C equinox show v0.13.8:tests/test_nn.py | grep -o "^def test_\\w*"

(Flax's `tests/nnx/bridge/` is the same at v0.12.7, the last tag before the
pinned 0.12.8, and at its main branch on 2026-07-02.) Each conformance test
checks that every case listed is ported or listed as a difference; with
`HB_PEER_SOURCES` naming a folder that holds checkouts `flax/` and
`equinox/`, `check_against_sources` also checks these lists against the files
themselves (a new upstream case then fails until it is ported or listed).
"""

import os
import re
from typing import Mapping, Optional, Sequence

FLAX_BRIDGE = {
  "tests/nnx/bridge/module_test.py": (
    "test_update",
    "test_module_stack",
    "test_compact_basic",
    "test_mutable_state",
    "test_compact_parent_none",
    "test_dense_port",
    "test_metadata",
    "test_pure_nnx_submodule",
    "test_pure_nnx_submodule_modified_rng",
    "test_linen_submodule",
    "test_name",
    "test_transforms",
    "test_shared_modules",
    "test_linen_layer_naming",
  ),
  "tests/nnx/bridge/wrappers_test.py": (
    "test_functional",
    "test_linen_to_nnx",
    "test_linen_to_nnx_submodule",
    "test_linen_to_nnx_noncall_method",
    "test_linen_to_nnx_mutable",
    "test_linen_to_nnx_transform",
    "test_linen_to_nnx_metadata",
    "test_linen_to_nnx_state_structure_consistency",
    "test_adding_new_attributes",
    "test_nnx_to_linen",
    "test_nnx_to_linen_multiple_rngs",
    "test_nnx_to_linen_multiple_collections",
    "test_nnx_to_linen_mutable",
    "test_to_linen_method_call",
    "test_to_linen_nnx_method_arg",
    "test_nnx_to_linen_mutated_static_data",
    "test_nnx_to_linen_transforms",
    "test_nnx_to_linen_metadata",
    "test_nnx_to_linen_metadata_transform",
    "test_nnx_to_linen_pytree_structure_consistency",
    "test_nnx_linen_nnx",
    "test_linen_nnx_linen",
  ),
}

EQUINOX = {
  "tests/test_nn.py": (
    "test_custom_init",
    "test_linear",
    "test_identity",
    "test_dropout_basic",
    "test_dropout_inference",
    "test_dropout_deterministic",
    "test_gru_cell",
    "test_lstm_cell",
    "test_sequential",
    "test_nested_sequential",
    "test_mlp",
    "test_scan_over_mlp_depth_one",
    "test_mlp_learnt_activation",
    "test_scan_over_mlp_learnt_activation",
    "test_conv1d",
    "test_conv2d",
    "test_conv3d",
    "test_conv_padding",
    "test_conv_circular",
    "test_convtranspose1d",
    "test_convtranspose2d",
    "test_convtranspose3d",
    "test_convtranspose_padding",
    "test_convtranspose_same_padding",
    "test_convtranspose_circular",
    "test_dot_product_attention_weights",
    "test_dot_product_attention",
    "test_multihead_attention",
    "test_multihead_attention_inference",
    "test_multihead_attention_deterministic",
    "test_embedding",
    "test_layer_norm",
    "test_group_norm",
    "test_batch_norm",
    "test_batch_norm_zero_training_steps",
    "test_spectral_norm",
    "test_weight_norm",
    "test_maxpool1d",
    "test_avgpool1d",
    "test_adaptive_avgpool1d",
    "test_adaptive_maxpool1d",
    "test_maxpool2d",
    "test_avgpool2d",
    "test_adaptive_avgpool2d",
    "test_adaptive_maxpool2d",
    "test_maxpool3d",
    "test_avgpool3d",
    "test_adaptive_avgpool3d",
    "test_adaptive_maxpool3d",
    "test_poolpadding",
    "test_poolbackprop",
    "test_poolnetworkbackprop",
    "test_lambda_layer",
    "test_prelu",
    "test_rope_embeddings_shapes",
    "test_rope_embeddings_freqs_cis",
    "test_rope_embeddings_values",
  ),
  "tests/test_stateful.py": ("test_delete_init_state", "test_double_state"),
  "tests/test_shared.py": (
    "test_shared_array",
    "test_shared_node",
    "test_mismatched_structure",
    "test_multi_shared",
  ),
}


def uncovered(
  cases: dict[str, tuple[str, ...]], test_case_classes: Sequence[type], listed: Mapping[str, str]
) -> set[str]:
  """The peer cases that `test_case_classes` neither port nor list.

  A case is ported by a test method named as it is (or with a suffix, for a
  parameterized case); `listed` maps a case to the reason it is not run.
  """
  ours = [n for c in test_case_classes for n in dir(c) if n.startswith("test_")]
  return {
    case
    for names in cases.values()
    for case in names
    if case not in listed and not any(n.startswith(case) for n in ours)
  }


def check_against_sources(library: str, cases: dict[str, tuple[str, ...]]) -> Optional[str]:
  """Differences between `cases` and the peer's files, if a checkout is given.

  Returns None without `HB_PEER_SOURCES`, else a description of the cases
  missing here or gone there ("" when they agree).
  """
  root = os.environ.get("HB_PEER_SOURCES")
  if not root:
    return None
  problems = []
  for path, names in cases.items():
    with open(os.path.join(root, library, path)) as f:
      found = set(re.findall(r"^\s*def (test_\w+)", f.read(), re.MULTILINE))
    if found != set(names):
      problems.append(
        f"{path}: not listed here {sorted(found - set(names))}, "
        f"gone there {sorted(set(names) - found)}"
      )
  return "; ".join(problems)
