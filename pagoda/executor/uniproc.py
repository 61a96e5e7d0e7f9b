"""In-process executor: one `ModelRunner` on one device, called directly by the engine."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagoda.config import EngineConfig
from pagoda.core.outputs import ModelRunnerOutput, SchedulerOutput

if TYPE_CHECKING:
    from pagoda.worker.model_runner import StepOutputFuture


class UniProcExecutor:
    def __init__(self, config: EngineConfig) -> None:
        from pagoda.worker.model_runner import ModelRunner

        self.config = config
        self.model_runner = ModelRunner(config)
        self.model_runner.load_model()

    def determine_num_blocks(self) -> int:
        return self.model_runner.determine_num_blocks()

    def bytes_per_block(self) -> int:
        return self.model_runner.bytes_per_block()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.model_runner.initialize_kv_cache(num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.model_runner.execute_model(scheduler_output)

    def execute_model_async(self, scheduler_output: SchedulerOutput) -> StepOutputFuture:
        """Launch the step; `.get()` on the result waits for its output."""
        return self.model_runner.execute_model_async(scheduler_output)

    def shutdown(self) -> None:
        """Nothing to stop: the runner lives and dies with this process."""
