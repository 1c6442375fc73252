"""What a checkpoint is: its format on disk, its manifest, what it holds, and how it is checked and found.

A change here changes what a checkpoint holds or how it is trusted (docs/checkpoint-format.md). No torch at
import: the controller reads manifests, markers and the catalog; only `state` and the readers of tensors
import torch. Modules:
- `format`: the layout of a step directory, file names, writing and reading parts.
- `manifest`: the record of every file's size and digest, written last.
- `stateful`: the registry of stateful parts (model, optimizer, ... and a user's `extra`).
- `state`: capturing the full training state (RNG included) and snapshotting it into host memory.
- `catalog`: which checkpoints exist, which to resume from, which to delete; markers.
- `validate`: integrity, structure and content checks, cheapest first.
- `completion`: COMPLETED.json, the marker of a finished job.
- `signing`, `safe_names`, `safe_load`, `safetensors_stream`: tamper evidence, the one rule for names read
  from a store, reading DCP without unpickling, the model file written tensor by tensor.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from spotrun.trainer.exports import lazy_exports

if TYPE_CHECKING:
    from spotrun.trainer.checkpoint.catalog import Catalog as Catalog
    from spotrun.trainer.checkpoint.catalog import Selection as Selection
    from spotrun.trainer.checkpoint.catalog import apply_retention as apply_retention
    from spotrun.trainer.checkpoint.catalog import fetch as fetch
    from spotrun.trainer.checkpoint.catalog import list_checkpoints as list_checkpoints
    from spotrun.trainer.checkpoint.catalog import prune_local as prune_local
    from spotrun.trainer.checkpoint.catalog import read_latest as read_latest
    from spotrun.trainer.checkpoint.catalog import select_newest_valid as select_newest_valid
    from spotrun.trainer.checkpoint.catalog import write_latest as write_latest
    from spotrun.trainer.checkpoint.completion import completed_eval as completed_eval
    from spotrun.trainer.checkpoint.completion import completed_for as completed_for
    from spotrun.trainer.checkpoint.completion import completed_step as completed_step
    from spotrun.trainer.checkpoint.completion import mark_completed as mark_completed
    from spotrun.trainer.checkpoint.format import COMPLETED as COMPLETED
    from spotrun.trainer.checkpoint.format import LATEST as LATEST
    from spotrun.trainer.checkpoint.format import MODEL_FILE as MODEL_FILE
    from spotrun.trainer.checkpoint.format import checkpoint_uri as checkpoint_uri
    from spotrun.trainer.checkpoint.format import fsync_file as fsync_file
    from spotrun.trainer.checkpoint.format import load_part as load_part
    from spotrun.trainer.checkpoint.format import parse_step_dir as parse_step_dir
    from spotrun.trainer.checkpoint.format import read_part as read_part
    from spotrun.trainer.checkpoint.format import sha256_file as sha256_file
    from spotrun.trainer.checkpoint.format import write_checkpoint_dir as write_checkpoint_dir
    from spotrun.trainer.checkpoint.format import write_part as write_part
    from spotrun.trainer.checkpoint.manifest import MANIFEST as MANIFEST
    from spotrun.trainer.checkpoint.manifest import SHARDED as SHARDED
    from spotrun.trainer.checkpoint.manifest import FileEntry as FileEntry
    from spotrun.trainer.checkpoint.manifest import Manifest as Manifest
    from spotrun.trainer.checkpoint.manifest import file_entry as file_entry
    from spotrun.trainer.checkpoint.manifest import step_dir as step_dir
    from spotrun.trainer.checkpoint.safe_load import SafeFileSystemReader as SafeFileSystemReader
    from spotrun.trainer.checkpoint.safe_load import SafeLoadPlanner as SafeLoadPlanner
    from spotrun.trainer.checkpoint.safe_load import load_full_state as load_full_state
    from spotrun.trainer.checkpoint.signing import KEY_ENV as KEY_ENV
    from spotrun.trainer.checkpoint.signing import OLD_KEYS_ENV as OLD_KEYS_ENV
    from spotrun.trainer.checkpoint.signing import keyring as keyring
    from spotrun.trainer.checkpoint.signing import marker_problem as marker_problem
    from spotrun.trainer.checkpoint.signing import sign_marker as sign_marker
    from spotrun.trainer.checkpoint.state import LaterCopies as LaterCopies
    from spotrun.trainer.checkpoint.state import RngState as RngState
    from spotrun.trainer.checkpoint.state import Snapshotter as Snapshotter
    from spotrun.trainer.checkpoint.state import TornSnapshot as TornSnapshot
    from spotrun.trainer.checkpoint.state import capture_rng as capture_rng
    from spotrun.trainer.checkpoint.state import host_copy as host_copy
    from spotrun.trainer.checkpoint.state import iter_tensors as iter_tensors
    from spotrun.trainer.checkpoint.state import local_of as local_of
    from spotrun.trainer.checkpoint.state import state_nbytes as state_nbytes
    from spotrun.trainer.checkpoint.state import update_only_views as update_only_views
    from spotrun.trainer.checkpoint.state import view_of as view_of
    from spotrun.trainer.checkpoint.stateful import DCP_METADATA as DCP_METADATA
    from spotrun.trainer.checkpoint.stateful import Codec as Codec
    from spotrun.trainer.checkpoint.stateful import Expectation as Expectation
    from spotrun.trainer.checkpoint.stateful import Registry as Registry
    from spotrun.trainer.checkpoint.stateful import Stateful as Stateful
    from spotrun.trainer.checkpoint.stateful import reconcile as reconcile
    from spotrun.trainer.checkpoint.stateful import spec_of as spec_of
    from spotrun.trainer.checkpoint.stateful import unwrap as unwrap
    from spotrun.trainer.checkpoint.validate import Problem as Problem
    from spotrun.trainer.checkpoint.validate import read_manifest as read_manifest
    from spotrun.trainer.checkpoint.validate import validate_dir as validate_dir

# name: the module of this room that defines it (imported when the name is first read)
_WHERE = {
    "COMPLETED": "format",
    "Catalog": "catalog",
    "Codec": "stateful",
    "DCP_METADATA": "stateful",
    "Expectation": "stateful",
    "FileEntry": "manifest",
    "KEY_ENV": "signing",
    "LATEST": "format",
    "LaterCopies": "state",
    "MANIFEST": "manifest",
    "MODEL_FILE": "format",
    "Manifest": "manifest",
    "OLD_KEYS_ENV": "signing",
    "Problem": "validate",
    "Registry": "stateful",
    "RngState": "state",
    "SHARDED": "manifest",
    "SafeFileSystemReader": "safe_load",
    "SafeLoadPlanner": "safe_load",
    "Selection": "catalog",
    "Snapshotter": "state",
    "Stateful": "stateful",
    "TornSnapshot": "state",
    "apply_retention": "catalog",
    "capture_rng": "state",
    "checkpoint_uri": "format",
    "completed_eval": "completion",
    "completed_for": "completion",
    "completed_step": "completion",
    "fetch": "catalog",
    "file_entry": "manifest",
    "fsync_file": "format",
    "host_copy": "state",
    "iter_tensors": "state",
    "keyring": "signing",
    "list_checkpoints": "catalog",
    "load_full_state": "safe_load",
    "load_part": "format",
    "local_of": "state",
    "mark_completed": "completion",
    "marker_problem": "signing",
    "parse_step_dir": "format",
    "prune_local": "catalog",
    "read_latest": "catalog",
    "read_manifest": "validate",
    "read_part": "format",
    "reconcile": "stateful",
    "select_newest_valid": "catalog",
    "sha256_file": "format",
    "sign_marker": "signing",
    "spec_of": "stateful",
    "state_nbytes": "state",
    "step_dir": "manifest",
    "unwrap": "stateful",
    "update_only_views": "state",
    "validate_dir": "validate",
    "view_of": "state",
    "write_checkpoint_dir": "format",
    "write_latest": "catalog",
    "write_part": "format",
}
__getattr__ = lazy_exports(__name__, _WHERE)
