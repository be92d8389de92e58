# python serve_tokens.py PORT  (2026-12-07, the 2-core CPU) against a server started as
#   python -m jaxllm.serve SmolLM2-135M-Instruct.Q4_1.gguf --served-model-name m --port PORT --max-batch 4 --max-context 4096 -q
# Times a streamed request on a running server: (json_object | free) x 2; ms a token from the first content chunk
# to the last, over the completion's tokens after the first (usage).
import json, sys, time, http.client
port = int(sys.argv[1])
def run(fmt):
  body = {"model": "m", "messages": [{"role": "user", "content": "Describe a cat as a JSON object with five fields."}],
          "max_tokens": 64, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
  if fmt:
    body["response_format"] = {"type": "json_object"}
  conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
  conn.request("POST", "/v1/chat/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
  resp = conn.getresponse()
  times, usage = [], None
  for line in resp:
    line = line.decode().strip()
    if not line.startswith("data: {"):
      continue
    ev = json.loads(line[6:])
    if ev.get("usage"):
      usage = ev["usage"]
    if ev.get("choices") and ev["choices"][0]["delta"].get("content"):
      times.append(time.perf_counter())
  conn.close()
  n = usage["completion_tokens"]
  return (times[-1] - times[0]) / (n - 1) * 1e3, n
for rep in range(2):
  for fmt in (True, False):
    ms, n = run(fmt)
    print(f"{'json_object' if fmt else 'free'}: {ms:.1f} ms a token ({n} tokens)", flush=True)
