"""What one shard's lifecycle (:mod:`~espnet3_flows.parallel.shard_lifecycle`) uses of a runner:
:class:`ShardRunner`. :class:`~espnet3_flows.parallel.base_runner.BaseRunner` is one; the
lifecycle types against this protocol so that it needs nothing of the runner's module."""

from __future__ import annotations

from typing import Any, Protocol
from collections.abc import Mapping, Sequence

from espnet3_flows.parallel.results import ShardResult, ShardStatus
from espnet3_flows.sharding import Shard
from espnet3_flows.storage import Storage


class ShardRunner(Protocol):
    """A runner as a shard's lifecycle drives it: ESPnet3's hooks, where a shard's files go, and
    how a bad item is handled (each member is documented on
    :class:`~espnet3_flows.parallel.base_runner.BaseRunner`)."""

    batch_size: int | str | None
    shard_subdir: str
    resume: bool
    on_error: str
    staging_dir: str | None
    item_errors: tuple[type[BaseException], ...]

    @property
    def storage(self) -> Storage | None: ...

    def forward(self, idx: Any, **resources: Any) -> Any: ...

    def init_state(self, shard_id: Any = 0, output_dir: str = "", shard_subdir: str = "",
                   shard_name: str | None = None, **resources: Any) -> dict[str, Any]: ...

    def reduce_state(self, state: dict[str, Any], result: Any, **resources: Any) -> dict[str, Any]: ...

    def finalize_state(self, state: dict[str, Any], **resources: Any) -> dict[str, Any]: ...

    def shard_resources(self, shard: Shard, resources: Mapping[str, Any]) -> Mapping[str, Any]: ...

    def check_resource_keys(self, keys: Sequence[str]) -> None: ...

    def describe_item(self, idx: Any, resources: Mapping[str, Any]) -> str: ...

    def skip_record(self, idx: Any, resources: Mapping[str, Any], exc: BaseException) -> dict[str, Any]: ...

    def shard_rel(self, shard: Shard | ShardStatus, *parts: str) -> str: ...

    def load_done(self, shard: Shard) -> ShardResult | None: ...
