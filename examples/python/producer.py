"""A vramgate producer in Python: sends request events built against the published contract
(schemas/v1), then reads the results and dead letters that come back and holds each to its
schema too.

    python producer.py --brokers 127.0.0.1:9092 --schemas ../../schemas/v1 \
        --voice-topics voice.requests voice.results voice.dlq \
        --image-topics image.requests image.results image.dlq \
        --wav speech.wav --image photo.png

Each file goes inline (base64), as `file://` URIs only work for files under the gateway's
input root. One more request names a file that is not there, to show a dead letter. Exits
non-zero when an event breaks its schema, an answer does not come within --timeout, or an
answer is not what the request should get. Needs confluent-kafka and jsonschema (pip).
"""

import argparse
import base64
import json
import pathlib
import sys
import time
import uuid

import jsonschema
from confluent_kafka import Consumer, Producer


def load_schemas(folder):
    folder = pathlib.Path(folder)
    schemas = {}
    for name in ("request", "result", "dead-letter", "voice-output", "image-output"):
        schema = json.loads((folder / f"{name}.json").read_text())
        jsonschema.Draft202012Validator.check_schema(schema)
        schemas[name] = jsonschema.Draft202012Validator(schema)
    return schemas


def valid(schemas, name, value):
    errors = sorted(schemas[name].iter_errors(value), key=lambda e: list(e.path))
    if errors:
        raise SystemExit(f"breaks {name}.json: " + "; ".join(f"{e.message} at {list(e.path)}" for e in errors[:5]))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--brokers", required=True)
    parser.add_argument("--schemas", required=True, help="the folder of the contract's JSON Schemas")
    parser.add_argument("--voice-topics", nargs=3, metavar=("REQUESTS", "RESULTS", "DLQ"), required=True)
    parser.add_argument("--image-topics", nargs=3, metavar=("REQUESTS", "RESULTS", "DLQ"), required=True)
    parser.add_argument("--wav", required=True)
    parser.add_argument("--image", required=True)
    parser.add_argument("--timeout", type=float, default=120.0)
    args = parser.parse_args()
    schemas = load_schemas(args.schemas)

    def request(task, data=None, uri=None, options=None):
        event = {"version": 1, "id": f"py-{task}-{uuid.uuid4()}", "task": task,
                 "input": {"data_b64": base64.b64encode(data).decode()} if data is not None else {"uri": uri}}
        if options is not None:
            event["options"] = options
        valid(schemas, "request", event)
        return event

    # request.json types each built-in task's options: a threshold past 1 is refused here,
    # before it reaches Kafka, as the gateway would refuse it.
    if schemas["request"].is_valid({"id": "x", "task": "voice", "input": {"uri": "file:///x.wav"},
                                    "options": {"threshold": 1.5}}):
        sys.exit("request.json accepted a voice threshold of 1.5")

    sent = {
        # The voice task's own segment parameters, given per request (the defaults' values).
        "voice": request("voice", data=pathlib.Path(args.wav).read_bytes(),
                         options={"threshold": 0.5, "min_silence_ms": 100}),
        "image": request("image", data=pathlib.Path(args.image).read_bytes()),
        "missing": request("voice", uri="file:///no/such/file.wav"),
    }
    # The results and dead letters are read from the start of their topics: subscribe first.
    consumer = Consumer({"bootstrap.servers": args.brokers, "group.id": f"py-producer-{uuid.uuid4()}",
                         "auto.offset.reset": "earliest", "enable.auto.commit": False,
                         "isolation.level": "read_committed"})
    consumer.subscribe([args.voice_topics[1], args.voice_topics[2], args.image_topics[1], args.image_topics[2]])
    producer = Producer({"bootstrap.servers": args.brokers, "enable.idempotence": True})
    topics = {"voice": args.voice_topics[0], "image": args.image_topics[0], "missing": args.voice_topics[0]}
    for name, event in sent.items():
        producer.produce(topics[name], key=event["id"].encode(), value=json.dumps(event).encode())
    if producer.flush(30) != 0:
        raise SystemExit("the requests were not all delivered within 30 s")
    print(f"sent {len(sent)} requests: {', '.join(e['id'] for e in sent.values())}")

    wanted = {event["id"]: name for name, event in sent.items()}
    answers = {}
    deadline = time.monotonic() + args.timeout
    while len(answers) < len(wanted) and time.monotonic() < deadline:
        message = consumer.poll(0.5)
        if message is None or message.error():
            continue
        value = json.loads(message.value())
        if value.get("id") not in wanted:
            continue
        answers[value["id"]] = (message.topic(), value)
    consumer.close()
    missing = [wanted[i] for i in wanted if i not in answers]
    if missing:
        raise SystemExit(f"no answer within {args.timeout} s for: {missing}")

    for id_, (topic, value) in answers.items():
        name = wanted[id_]
        if topic.endswith(".dlq"):
            valid(schemas, "dead-letter", value)
            if name != "missing":
                raise SystemExit(f"{name} was dead-lettered: {value['error']}")
            if value["error"]["kind"] != "input_not_found":
                raise SystemExit(f"the missing file's dead letter says {value['error']['kind']}")
            print(f"{name}: dead letter {value['error']['kind']}: {value['error']['message']}")
        else:
            valid(schemas, "result", value)
            valid(schemas, f"{name}-output", value["output"])
            if name == "voice":
                segments = value["output"]["segments"]
                if not segments:
                    raise SystemExit("no speech found in the spoken WAV")
                print(f"voice: {len(segments)} speech segment(s), first {segments[0]}")
            else:
                print(f"image: {len(value['output']['faces'])} face(s) in a {value['output']['width']}x{value['output']['height']} image")
    print("every event and answer matches schemas/v1")


if __name__ == "__main__":
    sys.exit(main())
