"""An OpenAI-compatible HTTP API in front of the Triton model `neo`, over Triton's gRPC streaming.

    python -m openai_frontend                 # http://127.0.0.1:9000/v1 ; `make serve` starts it beside Triton

Every request still goes through the Triton model (its limits, metrics and cancellation); the gateway renders
chats with the served model's own chat template and relays token counts, finish reasons and logprobs.
"""

from .app import create_app
from .config import GatewayConfig

__all__ = ["GatewayConfig", "create_app"]
