"""Send one image + text chat request to an MMInferenceService with the OpenAI SDK.

Usage: kubectl port-forward svc/tiny 8000:8000 &
       python examples/client.py http://127.0.0.1:8000/v1 /models/tiny-llava IMAGE.png
"""

from __future__ import annotations

import base64
import sys
from pathlib import Path

from openai import OpenAI


def main() -> None:
    base_url, model, image = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    data = base64.b64encode(image.read_bytes()).decode()
    client = OpenAI(base_url=base_url, api_key="unused-unless-auth-is-set")
    reply = client.chat.completions.create(
        model=model,
        max_tokens=32,
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "What is in this image?"},
                    {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{data}"}},
                ],
            }
        ],
    )
    print(reply.choices[0].message.content)


if __name__ == "__main__":
    main()
