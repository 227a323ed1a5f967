"""The collector: captured verify rows from the serving process to the trainer (contract 2).

    serving process                                        trainer daemon (sidecar)
    ---------------                                        ------------------------
    engine round -> CaptureRecord (online_spec.capture)
      publisher.should_capture(id)  once per request       CaptureSubscriber (SUB, connects)
      publisher.submit(records)     once per round           wire.decode: bad messages counted, dropped
      publisher.end_request(id)     when it finishes          SpanAssembler: adjacent records -> CaptureSpan
    CapturePublisher (XPUB, binds)                           ReplayBuffer.add(span)
      bounded queue, sender thread,      ---- ZMQ ---->        memory window + datasets shards on disk
      wire.encode, non-blocking send                          sample_train(max_tokens), heldout(max_tokens)

- `wire`       the versioned message format (header + raw tensor frames), `encode`/`decode`
- `publisher`  `CapturePublisher`, `PublisherConfig`: sampling per request, never blocks decode;
               whatever cannot be queued or sent is dropped and counted
- `subscriber` `CaptureSubscriber`, `SubscriberConfig`: receive, validate, reassemble
- `assembler`  `SpanAssembler`: the rules that join records into spans (never across a gap)
- `span`       `CaptureSpan`: a contiguous run of one request's rows with per-row accept info
- `shards`     the on-disk schema (HF datasets), `save_spans`/`load_spans` for offline data too
- `replay`     `ReplayBuffer`, `ReplayConfig`: byte-bounded, held-out slice, survives kill -9
- `replay_reader` `GenerationReader`: a buffer's stored rows read by name from another process
                 (a trainer rank on the same host), `Drawn`: a draw as rows and/or their location
- `endpoint`   the default ipc endpoint and endpoint validation

See docs/collector.md for the wire table, drop semantics and the buffer layout.
"""
