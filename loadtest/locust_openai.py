"""Locust user that drives the OpenAI-compatible gateway with the official `openai` SDK: streaming
`/v1/completions` with the same prompts and exact output lengths as the gRPC user (the workload's sampling
parameters go in the body as they are; `ignore_eos` is a vLLM extra the gateway accepts), token counts from the
stream's `usage`. Entries are of type `openai` (see loadtest/users.py). `--host` is the gateway's base URL.

Run directly (web UI): `locust -f loadtest/locust_openai.py --host http://127.0.0.1:9000`; headless:
`python -m loadtest --api openai`.
"""

from __future__ import annotations

import time
import uuid

import openai

from client import ClientError, GenerationResult
from loadtest.users import StreamingUser
from loadtest.workloads import RequestSpec
from openai_frontend import GatewayConfig


class IncompleteStreamError(ClientError):
    """The stream ended without its usage chunk."""


class OpenAIUser(StreamingUser):
    host = GatewayConfig.from_env().url
    request_type = "openai"
    request_errors = (openai.OpenAIError, IncompleteStreamError)

    def connect(self) -> None:
        self.api = openai.OpenAI(
            base_url=f"{self.host.rstrip('/')}/v1",
            timeout=self.opts.request_timeout,
            api_key=GatewayConfig.from_env().api_key or "unused",
            max_retries=0,
        )
        self.api.models.retrieve(self.opts.model)

    def disconnect(self) -> None:
        self.api.close()

    def send(self, spec: RequestSpec) -> GenerationResult:
        start = time.perf_counter()
        first_token_time, parts, usage, finish_reason = None, [], None, None
        stream = self.api.completions.create(
            model=self.opts.model,
            prompt=spec.prompt,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=spec.sampling(),
        )
        with stream:
            for chunk in stream:
                if chunk.usage is not None:
                    usage = chunk.usage
                if not chunk.choices:
                    continue
                if chunk.choices[0].text:
                    parts.append(chunk.choices[0].text)
                    first_token_time = first_token_time or time.perf_counter()
                finish_reason = chunk.choices[0].finish_reason or finish_reason
        if usage is None:
            raise IncompleteStreamError("the stream ended without its usage chunk")
        return GenerationResult(
            request_id=uuid.uuid4().hex,
            text="".join(parts),
            finish_reason=finish_reason,
            num_input_tokens=usage.prompt_tokens,
            num_output_tokens=usage.completion_tokens,
            start_time=start,
            first_token_time=first_token_time,
            end_time=time.perf_counter(),
        )
