"""The chat template: `dlm chat` and the server's /v1/chat/completions (dlm.serve.protocol) share it.

The reference models are not chat-tuned, so the template is plain and documented rather than
learned: one `### Role` header line per message, its content, a blank line; the prompt ends with
`### Assistant` and a newline for the model to continue. Generation stops at STOP, the start of a
next header. system and developer messages are `### System`.
"""

from __future__ import annotations

STOP = "\n### "


def chat_prompt(messages: list[tuple[str, str]]) -> str:
    """messages: (role, content) pairs, role one of system, developer, user, assistant."""
    parts = []
    for role, content in messages:
        name = "System" if role in ("system", "developer") else role.capitalize()
        parts.append(f"### {name}\n{content}\n\n")
    return "".join(parts) + "### Assistant\n"


def reply_of(text: str) -> str:
    """The assistant's reply in a generated text: up to the next header."""
    return text.split(STOP, 1)[0]
