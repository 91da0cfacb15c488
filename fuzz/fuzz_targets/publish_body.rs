//! Publish-body parsing never panics on any bytes, and whatever it accepts respects the limits
//! and the id alphabets.
#![no_main]

use libfuzzer_sys::fuzz_target;
use posthorn::{
    config::Config,
    http::publish::parse_batch,
    model::{DeviceId, EventType, Target},
};

fuzz_target!(|input: &[u8]| {
    let limits = Config::default().limits;
    if let Ok(events) = parse_batch(input, &limits) {
        assert!(!events.is_empty() && events.len() <= limits.max_batch);
        for event in events {
            assert!(event.data.len() <= limits.max_event_bytes);
            assert!(EventType::parse(event.event_type.as_str()).is_ok());
            if let Target::Device(device) = &event.target {
                assert!(DeviceId::parse(device.as_str()).is_ok());
            }
        }
    }
});
