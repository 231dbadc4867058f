//! The `tensor` task's input, as the gateway converts it: the event's tensor as JSON, in OIP's
//! JSON form (`data`, flat or nested) or as raw bytes in base64 (`data_b64`), one input or
//! several by name, decoded by the worker protocol's own decoder under the task's
//! `max_elements` and `datatype` (`tasks::tensor`), through the task's own plans
//! ([`vramgate_fuzz::tensor_converters`]).
//!
//! Checked: no refusal is `internal`; the probe's peak covers the tensors made; every tensor
//! holds what its shape says and reaches the worker as it left
//! ([`vramgate_fuzz::check_calls`]).

#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    vramgate_fuzz::convert_with_every_row(vramgate_fuzz::tensor_converters, data, |plan, converted| {
        let peak = plan.probe(data).expect("it converted");
        let held: usize = converted.calls.iter().flat_map(|call| &call.inputs).map(|t| t.data.byte_len()).sum();
        assert!(held as u64 <= peak, "{held} tensor bytes, a peak of {peak} reserved");
    });
});
