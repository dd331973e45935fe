"""Tool calling: OpenAI-style tool calls in the Hermes `<tool_call>` format (Qwen's), parsed
from generated text, and a sandboxed Python runner to answer them."""
