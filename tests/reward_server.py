"""A real HTTP reward server for the reward_url tests, in a thread of the test process.

It scores each sample with tests.ppo_tasks.low_token_fraction on its token ids (native
format) or with the length of the query text (openrlhf format), records every request (body
and headers), and can be told to fail: `fail_next` answers the next requests with HTTP
status codes (a 301/302/307 redirects elsewhere), `fail_when(body)` answers 503 to every
request it holds true for (a batch that fails each time), `delay` sleeps before answering,
`reply` replaces the answer.
"""

from __future__ import annotations

import http.server
import json
import threading
import time

from tests.ppo_tasks import low_token_fraction


class RewardServer:
    def __init__(self):
        self.requests: list[tuple[dict, dict]] = []  # (body, headers)
        self.fail_next: list[int] = []
        self.fail_when = None
        self.delay = 0.0
        self.reply = None
        self.lock = threading.Lock()
        owner = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 (http.server's name)
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with owner.lock:
                    owner.requests.append((body, dict(self.headers)))
                    status = owner.fail_next.pop(0) if owner.fail_next else 200
                    if owner.fail_when is not None and owner.fail_when(body):
                        status = 503
                time.sleep(owner.delay)
                if status in (301, 302, 307):
                    self.send_response(status)
                    self.send_header("Location", "http://127.0.0.1:1/elsewhere")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                if status != 200:
                    self.send_error(status, "told to fail")
                    return
                answer = owner.reply if owner.reply is not None else owner.score(body)
                data = json.dumps(answer).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.http = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}/score"
        self.thread = threading.Thread(target=self.http.serve_forever, daemon=True)
        self.thread.start()

    @staticmethod
    def score(body: dict) -> dict:
        if "query" in body:  # OpenRLHF's format
            return {"rewards": [float(len(q)) for q in body["query"]]}
        scores = [low_token_fraction(p, r)
                  for p, r in zip(body["prompt_ids"], body["response_ids"])]
        return {"scores": scores, "length": [float(len(r)) for r in body["response_ids"]]}

    def close(self) -> None:
        self.http.shutdown()
        self.http.server_close()
