//! Measures the gateway's WAV decoding and resampling against the maintained crates
//! (`hound`, `symphonia` with only `wav` + `pcm`, `rubato`), for the decision written in
//! `api-gateway/src/audio/{wav,resample}.rs` and `docs/gateway.md`.
//!
//! ```sh
//! source scripts/env.sh
//! cargo run --release -p vramgate-gateway --example audio_libs
//! ```
//!
//! Three parts: (a) decode speed on 60 s files of four formats, (b) which files each decoder
//! takes or refuses and whether they agree on the samples, (c) resampling speed and quality.
//! `espeak-ng`, when installed, adds two real files: one written with `-w` and one written to
//! stdout, whose header carries the placeholder sizes a streaming writer leaves.

use std::io::Cursor;
use std::time::Instant;

use rubato::audioadapter_buffers::direct::InterleavedSlice;
use rubato::{Async, Fft, FixedAsync, FixedSync, Resampler, SincInterpolationParameters};
use vramgate_shared::wav::SampleFormat as Enc;
use vramgate_shared::wav::{chunk, fmt_body, fmt_extensible, riff, wav_bytes};
use vramgate_gateway::audio::{resample, wav};

type Decoded = Result<(u32, u16, Vec<f32>), String>;
type Decoder = fn(&[u8]) -> Decoded;
type Resample = fn(&[f32], u32, u32) -> Vec<f32>;

// ---------------------------------------------------------------- decoders under test

fn ours(bytes: &[u8]) -> Decoded {
    let audio = wav::decode_wav(bytes).map_err(|e| e.to_string())?;
    Ok((audio.sample_rate, audio.channels, audio.samples))
}

fn hound(bytes: &[u8]) -> Decoded {
    let reader = hound::WavReader::new(Cursor::new(bytes)).map_err(|e| e.to_string())?;
    let spec = reader.spec();
    let samples: Result<Vec<f32>, hound::Error> = match spec.sample_format {
        hound::SampleFormat::Float => reader.into_samples::<f32>().collect(),
        hound::SampleFormat::Int => {
            let scale = 1.0 / (1u64 << (spec.bits_per_sample - 1)) as f32;
            reader
                .into_samples::<i32>()
                .map(|s| s.map(|v| v as f32 * scale))
                .collect()
        }
    };
    Ok((
        spec.sample_rate,
        spec.channels,
        samples.map_err(|e| e.to_string())?,
    ))
}

fn symphonia(bytes: &[u8]) -> Decoded {
    use symphonia::core::codecs::audio::AudioDecoderOptions;
    use symphonia::core::formats::{FormatOptions, FormatReader, TrackType};
    use symphonia::core::io::MediaSourceStream;
    use symphonia::default::formats::WavReader;

    let mss = MediaSourceStream::new(Box::new(Cursor::new(bytes)), Default::default());
    let mut reader =
        WavReader::try_new(mss, FormatOptions::default()).map_err(|e| e.to_string())?;
    let track = reader
        .default_track(TrackType::Audio)
        .ok_or("no audio track")?;
    let params = track
        .codec_params
        .as_ref()
        .and_then(|p| p.audio())
        .ok_or("no audio params")?
        .clone();
    let track_id = track.id;
    let rate = params.sample_rate.ok_or("no rate")?;
    let channels = params
        .channels
        .as_ref()
        .map(|c| c.count())
        .ok_or("no channels")? as u16;
    let mut decoder = symphonia::default::get_codecs()
        .make_audio_decoder(&params, &AudioDecoderOptions::default())
        .map_err(|e| e.to_string())?;
    let mut samples: Vec<f32> = Vec::new();
    loop {
        let packet = match reader.next_packet() {
            Ok(Some(p)) => p,
            Ok(None) => break,
            Err(e) => return Err(format!("packet: {e}")),
        };
        if packet.track_id != track_id {
            continue;
        }
        let buf = decoder.decode(&packet).map_err(|e| e.to_string())?;
        let at = samples.len();
        samples.resize(at + buf.samples_interleaved(), 0.0);
        buf.copy_to_slice_interleaved(&mut samples[at..]);
    }
    if samples.is_empty() {
        return Err("no samples".into());
    }
    Ok((rate, channels, samples))
}

const DECODERS: [(&str, Decoder); 3] =
    [("wav.rs", ours), ("hound", hound), ("symphonia", symphonia)];

// ---------------------------------------------------------------- test content (files: vramgate_shared::wav)

/// Speech-like test content: a few harmonics with a slow amplitude wobble and a little noise.
fn content(channels: u16, rate: u32, seconds: f64) -> Vec<f32> {
    let frames = (seconds * f64::from(rate)) as usize;
    let mut seed = 0x1234_5678u32;
    let mut out = Vec::with_capacity(frames * usize::from(channels));
    for i in 0..frames {
        let t = i as f64 / f64::from(rate);
        let env = 0.5 + 0.4 * (2.0 * std::f64::consts::PI * 3.0 * t).sin();
        let tone: f64 = [180.0, 360.0, 720.0, 2_400.0]
            .iter()
            .enumerate()
            .map(|(k, f)| (2.0 * std::f64::consts::PI * f * t).sin() / (k + 1) as f64)
            .sum();
        for c in 0..channels {
            seed = seed.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            let noise = (f64::from(seed >> 8) / f64::from(1u32 << 24) - 0.5) * 0.02;
            out.push((env * tone * 0.4 * (1.0 - 0.1 * f64::from(c)) + noise) as f32);
        }
    }
    out
}

// ---------------------------------------------------------------- (a) decode speed

fn best_of<T>(runs: usize, mut f: impl FnMut() -> T) -> (f64, T) {
    let mut best = f64::INFINITY;
    let mut last = None;
    for _ in 0..runs {
        let start = Instant::now();
        let out = std::hint::black_box(f());
        best = best.min(start.elapsed().as_secs_f64());
        last = Some(out);
    }
    (best, last.expect("runs >= 1"))
}

fn decode_speed() {
    println!("\n## (a) decode speed: 60 s files, best of 5, ms (x realtime)\n");
    println!("| file | bytes | wav.rs | hound | symphonia |");
    println!("|---|---|---|---|---|");
    let cases = [
        ("16-bit mono 16 kHz", Enc::I16, 1u16, 16_000u32),
        ("16-bit stereo 44.1 kHz", Enc::I16, 2, 44_100),
        ("24-bit stereo 48 kHz", Enc::I24, 2, 48_000),
        ("float32 mono 48 kHz", Enc::F32, 1, 48_000),
    ];
    for (name, enc, channels, rate) in cases {
        let bytes = wav_bytes(enc, channels, rate, &content(channels, rate, 60.0));
        let mut row = format!("| {name} | {} |", bytes.len());
        for (_, decode) in DECODERS {
            let (secs, out) = best_of(5, || decode(std::hint::black_box(&bytes)));
            match out {
                Ok(_) => row += &format!(" {:.1} ({:.0}x) |", secs * 1e3, 60.0 / secs),
                Err(e) => row += &format!(" refused: {e} |"),
            }
        }
        println!("{row}");
    }
}

// ---------------------------------------------------------------- (b) acceptance and agreement

fn espeak(args: &[&str], stdout_file: bool) -> Option<Vec<u8>> {
    let path = std::env::temp_dir().join(format!(
        "audio_libs_{}_{}.wav",
        std::process::id(),
        stdout_file
    ));
    let mut cmd = std::process::Command::new("espeak-ng");
    if stdout_file {
        cmd.arg("--stdout")
            .args(args)
            .stdout(std::fs::File::create(&path).ok()?);
    } else {
        cmd.arg("-w").arg(&path).args(args);
    }
    let ok = cmd.status().ok()?.success();
    let bytes = std::fs::read(&path).ok();
    let _ = std::fs::remove_file(&path);
    bytes.filter(|_| ok)
}

fn acceptance() {
    println!("\n## (b) acceptance: frames decoded (max |difference| from wav.rs) or the refusal\n");
    let s1 = content(1, 16_000, 0.25);
    let s2 = content(2, 22_050, 0.25);
    let fmt16 = chunk(b"fmt ", &fmt_body(1, 1, 16_000, 16), None);
    let data16 = Enc::I16.encode(&s1);
    let mut files: Vec<(String, Vec<u8>)> = Vec::new();
    for enc in [Enc::U8, Enc::I16, Enc::I24, Enc::I32, Enc::F32, Enc::F64] {
        files.push((format!("plain {enc:?} stereo"), wav_bytes(enc, 2, 22_050, &s2)));
    }
    for (enc, valid, sub) in [
        (Enc::I16, 16, 1),
        (Enc::I24, 24, 1),
        (Enc::I24, 20, 1),
        (Enc::I32, 24, 1),
        (Enc::F32, 32, 3),
    ] {
        files.push((
            format!("EXTENSIBLE {enc:?} ({valid} valid bits)"),
            riff(
                &[
                    chunk(
                        b"fmt ",
                        &fmt_extensible(2, 22_050, enc.bits(), valid, sub),
                        None,
                    ),
                    chunk(b"data", &enc.encode(&s2), None),
                ],
                None,
            ),
        ));
    }
    let mut fmt18 = fmt_body(1, 1, 16_000, 16);
    fmt18.extend_from_slice(&0u16.to_le_bytes()); // cbSize = 0, as WAVEFORMATEX writers do
    files.push((
        "fmt of 18 bytes (cbSize 0)".into(),
        riff(
            &[chunk(b"fmt ", &fmt18, None), chunk(b"data", &data16, None)],
            None,
        ),
    ));
    files.push((
        "LIST INFO with an odd string, padded inside".into(),
        riff(
            &[
                fmt16.clone(),
                chunk(b"LIST", b"INFOISFT\x03\0\0\0ab\0\0", None),
                chunk(b"data", &data16, None),
            ],
            None,
        ),
    ));
    files.push((
        "LIST whose size leaves out its last pad byte".into(),
        riff(
            &[
                fmt16.clone(),
                chunk(b"LIST", b"INFOISFT\x03\0\0\0ab\0", None),
                chunk(b"data", &data16, None),
            ],
            None,
        ),
    ));
    files.push((
        "odd-sized unknown chunk between fmt and data".into(),
        riff(
            &[
                fmt16.clone(),
                chunk(b"afsp", &[b'x'; 9], None),
                chunk(b"data", &data16, None),
            ],
            None,
        ),
    ));
    files.push((
        "odd-sized JUNK chunk before fmt".into(),
        riff(
            &[
                chunk(b"JUNK", &[0; 7], None),
                fmt16.clone(),
                chunk(b"data", &data16, None),
            ],
            None,
        ),
    ));
    files.push((
        "odd-sized u8 data chunk".into(),
        wav_bytes(Enc::U8, 1, 8_000, &s1[..1_001]),
    ));
    files.push((
        "chunks after data".into(),
        riff(
            &[
                fmt16.clone(),
                chunk(b"data", &data16, None),
                chunk(b"LIST", &[1, 2, 3, 4], None),
            ],
            None,
        ),
    ));
    files.push((
        "data size 0xFFFFFFFF, RIFF size 0xFFFFFFFF".into(),
        riff(
            &[fmt16.clone(), chunk(b"data", &data16, Some(u32::MAX))],
            Some(u32::MAX),
        ),
    ));
    files.push((
        "data size 0x7FFFF000 (espeak-ng/sox streaming)".into(),
        riff(
            &[fmt16.clone(), chunk(b"data", &data16, Some(0x7FFF_F000))],
            Some(0x7FFF_F024),
        ),
    ));
    files.push((
        "data size 0".into(),
        riff(&[fmt16.clone(), chunk(b"data", &data16, Some(0))], None),
    ));
    let mut cut = wav_bytes(Enc::I16, 2, 22_050, &s2);
    cut.truncate(cut.len() - 1_001); // upload cut mid-frame
    files.push(("file cut mid-frame (sizes say more)".into(), cut));
    files.push((
        "mu-law (tag 7)".into(),
        riff(
            &[
                chunk(b"fmt ", &fmt_body(7, 1, 8_000, 8), None),
                chunk(b"data", &[0xFF; 100], None),
            ],
            None,
        ),
    ));
    files.push((
        "12-bit PCM".into(),
        riff(
            &[
                chunk(b"fmt ", &fmt_body(1, 1, 8_000, 12), None),
                chunk(b"data", &[0; 100], None),
            ],
            None,
        ),
    ));
    files.push((
        "sample rate 1 Hz".into(),
        riff(
            &[
                chunk(b"fmt ", &fmt_body(1, 1, 1, 16), None),
                chunk(b"data", &[0; 100], None),
            ],
            None,
        ),
    ));
    files.push((
        "32767 channels".into(),
        riff(
            &[
                chunk(b"fmt ", &fmt_body(1, 32_767, 16_000, 8), None),
                chunk(b"data", &[0; 65_534], None),
            ],
            None,
        ),
    ));
    if let Some(b) = espeak(&["The quick brown fox jumps over the lazy dog."], false) {
        files.push(("espeak-ng -w (real file)".into(), b));
    }
    if let Some(b) = espeak(&["Streaming writers do not know the length."], true) {
        files.push(("espeak-ng --stdout (real, streaming header)".into(), b));
    }

    println!("| file | wav.rs | hound | symphonia |");
    println!("|---|---|---|---|");
    for (name, bytes) in &files {
        let reference = ours(bytes).ok();
        let mut row = format!("| {name} |");
        for (_, decode) in DECODERS {
            let cell = match decode(bytes) {
                Err(e) => format!("refused: {}", e.chars().take(60).collect::<String>()),
                Ok((rate, ch, samples)) => {
                    let frames = samples.len() / usize::from(ch.max(1));
                    match &reference {
                        Some((r0, c0, s0))
                            if *r0 == rate && *c0 == ch && s0.len() == samples.len() =>
                        {
                            let diff = s0
                                .iter()
                                .zip(&samples)
                                .map(|(a, b)| (a - b).abs())
                                .fold(0.0f32, f32::max);
                            format!("{frames} ({diff:.1e})")
                        }
                        Some((_, _, s0)) => {
                            format!("{frames} (wav.rs: {})", s0.len() / usize::from(ch.max(1)))
                        }
                        None => format!("{frames} @ {rate} Hz x{ch}"),
                    }
                }
            };
            row += &format!(" {cell} |");
        }
        println!("{row}");
    }
}

// ---------------------------------------------------------------- (c) resampling

fn rubato_fft(x: &[f32], from: u32, to: u32) -> Vec<f32> {
    let mut r = Fft::<f32>::new(from as usize, to as usize, 1024, 1, FixedSync::Both)
        .expect("fft resampler");
    let input = InterleavedSlice::new(x, 1, x.len()).expect("adapter");
    r.process_all(&input, x.len(), None)
        .expect("process_all")
        .take_data()
}

fn rubato_sinc(x: &[f32], from: u32, to: u32) -> Vec<f32> {
    let params = SincInterpolationParameters::default();
    let mut r = Async::<f32>::new_sinc(
        f64::from(to) / f64::from(from),
        1.0,
        &params,
        1024,
        1,
        FixedAsync::Input,
    )
    .expect("sinc resampler");
    let input = InterleavedSlice::new(x, 1, x.len()).expect("adapter");
    r.process_all(&input, x.len(), None)
        .expect("process_all")
        .take_data()
}

/// The gateway's `audio::resample` as it is now (a wrapper over rubato `Fft`, sinc past
/// `MAX_FFT_BLOCK`). The hand-written resampler it replaced was measured with this example at
/// commit 1a0adfc (before issue 13); its figures are in `audio/resample.rs`.
fn gateway(x: &[f32], from: u32, to: u32) -> Vec<f32> {
    resample::resample(x, from, to).expect("resamples")
}

const RESAMPLERS: [(&str, Resample); 3] = [
    ("audio::resample", gateway),
    ("rubato Fft", rubato_fft),
    ("rubato sinc (256 taps)", rubato_sinc),
];

fn sine(freq: f64, rate: u32, seconds: f64, amp: f64, phase_at: f64) -> Vec<f32> {
    let n = (seconds * f64::from(rate)) as usize;
    (0..n)
        .map(|i| {
            (amp * (2.0 * std::f64::consts::PI * freq * (i as f64 / f64::from(rate) + phase_at))
                .sin()) as f32
        })
        .collect()
}

/// Amplitude of `freq` in `x`, by one Blackman-Harris-windowed DFT bin (sidelobes < -92 dB).
fn tone_amplitude(x: &[f32], rate: u32, freq: f64) -> f64 {
    let n = x.len();
    let (mut re, mut im, mut wsum) = (0.0, 0.0, 0.0);
    for (i, &v) in x.iter().enumerate() {
        let p = 2.0 * std::f64::consts::PI * i as f64 / (n - 1) as f64;
        let w = 0.35875 - 0.48829 * p.cos() + 0.14128 * (2.0 * p).cos() - 0.01168 * (3.0 * p).cos();
        let a = 2.0 * std::f64::consts::PI * freq * i as f64 / f64::from(rate);
        re += w * f64::from(v) * a.cos();
        im -= w * f64::from(v) * a.sin();
        wsum += w;
    }
    2.0 * (re * re + im * im).sqrt() / wsum
}

/// Least-squares fit of `a sin + b cos` at `freq`: (residual RMS re the fitted tone's RMS in dB,
/// delay of the tone in output samples against a zero-phase sine).
fn fit_tone(x: &[f32], rate: u32, freq: f64, start: usize) -> (f64, f64) {
    let w = 2.0 * std::f64::consts::PI * freq / f64::from(rate);
    let (mut ss, mut cc, mut sc, mut xs, mut xc) = (0.0, 0.0, 0.0, 0.0, 0.0);
    for (i, &v) in x.iter().enumerate() {
        let (s, c) = (w * (start + i) as f64).sin_cos();
        ss += s * s;
        cc += c * c;
        sc += s * c;
        xs += f64::from(v) * s;
        xc += f64::from(v) * c;
    }
    let det = ss * cc - sc * sc;
    let (a, b) = ((xs * cc - xc * sc) / det, (xc * ss - xs * sc) / det);
    let resid: f64 = x
        .iter()
        .enumerate()
        .map(|(i, &v)| {
            let (s, c) = (w * (start + i) as f64).sin_cos();
            (f64::from(v) - a * s - b * c).powi(2)
        })
        .sum::<f64>()
        / x.len() as f64;
    let amp = (a * a + b * b).sqrt();
    // a sin + b cos = amp sin(wt + phi); a delay d shows as phi = -w d.
    let delay = -b.atan2(a) / w;
    (db(resid.sqrt() / (amp / 2f64.sqrt())), delay)
}

fn middle(x: &[f32], rate: u32) -> &[f32] {
    let m = (0.1 * f64::from(rate)) as usize;
    x.get(m..x.len().saturating_sub(m)).unwrap_or_default()
}

fn db(x: f64) -> f64 {
    20.0 * x.max(1e-12).log10()
}

fn resampling() {
    println!("\n## (c) resampling: 60 s mono, best of 3, input samples/s (output length for 1,000,001 input samples)\n");
    println!("| pair | audio::resample | rubato Fft | rubato sinc (256 taps) |");
    println!("|---|---|---|---|");
    for (from, to) in [
        (44_100u32, 16_000u32),
        (48_000, 16_000),
        (8_000, 16_000),
        (22_050, 16_000),
    ] {
        let x = content(1, from, 60.0);
        let odd = content(1, from, 1_000_001.0 / f64::from(from));
        let mut row = format!("| {from}->{to} |");
        for (_, f) in RESAMPLERS {
            let (secs, _) = best_of(3, || f(&x, from, to));
            let len = f(&odd[..1_000_001.min(odd.len())], from, to).len();
            row += &format!(" {:.1} M/s (len {len}) |", x.len() as f64 / secs / 1e6);
        }
        println!("{row}");
    }
    for from in [47_999u32, 383_987, 1_009] {
        let x = content(1, from, 10.0);
        let mut row = format!("| {from}->16000 (10 s, incl. setup) |");
        for (_, f) in RESAMPLERS {
            let (secs, y) = best_of(1, || f(&x, from, 16_000));
            row += &format!(
                " {:.1} M/s, {:.0} ms (len {}) |",
                x.len() as f64 / secs / 1e6,
                secs * 1e3,
                y.len()
            );
        }
        println!("{row}");
    }
    let want =
        |from: u32, to: u32| (1_000_001u64 * u64::from(to) + u64::from(from) / 2) / u64::from(from);
    println!(
        "\n(rounded ideal length: 44.1k {} / 48k {} / 8k {} / 22.05k {})",
        want(44_100, 16_000),
        want(48_000, 16_000),
        want(8_000, 16_000),
        want(22_050, 16_000)
    );

    println!("\n## (c) quality, 2 s tones, amplitude 0.5, 0.1 s trimmed at each end\n");
    println!("| measure | audio::resample | rubato Fft | rubato sinc (256 taps) |");
    println!("|---|---|---|---|");
    for (from, to) in [(44_100u32, 16_000u32), (48_000, 16_000), (8_000, 16_000)] {
        let x = sine(1_000.0, from, 2.0, 0.5, 0.0);
        let ideal = sine(1_000.0, to, 2.0, 0.5, 0.0);
        let mut row = format!("| 1 kHz error vs ideal sine, {from}->{to} (dB re signal) |");
        for (_, f) in RESAMPLERS {
            let y = f(&x, from, to);
            let n = y.len().min(ideal.len());
            let (a, b) = (middle(&y[..n], to), middle(&ideal[..n], to));
            let err = (a
                .iter()
                .zip(b)
                .map(|(p, q)| f64::from(p - q).powi(2))
                .sum::<f64>()
                / a.len() as f64)
                .sqrt();
            row += &format!(" {:.1} |", db(err / (0.5 / 2f64.sqrt())));
        }
        println!("{row}");
        let mut row =
            format!("| 1 kHz residual after best sine fit / delay, {from}->{to} (dB / samples) |");
        for (_, f) in RESAMPLERS {
            let y = f(&x, from, to);
            let m = (0.1 * f64::from(to)) as usize;
            let (resid, delay) = fit_tone(middle(&y, to), to, 1_000.0, m);
            row += &format!(" {resid:.1} / {delay:+.3} |");
        }
        println!("{row}");
    }
    for freq in [7_500.0, 7_900.0] {
        let mut row = format!("| passband level of {freq} Hz, 44.1k->16k (dB) |");
        let x = sine(freq, 44_100, 2.0, 0.5, 0.0);
        for (_, f) in RESAMPLERS {
            let y = f(&x, 44_100, 16_000);
            row += &format!(
                " {:.1} |",
                db(tone_amplitude(middle(&y, 16_000), 16_000, freq) / 0.5)
            );
        }
        println!("{row}");
    }
    for freq in [8_100.0, 8_500.0, 10_000.0, 15_000.0] {
        let alias = 16_000.0 - freq;
        let mut row = format!("| alias of {freq} Hz at {alias} Hz, 44.1k->16k (dB) |");
        let x = sine(freq, 44_100, 2.0, 0.5, 0.0);
        for (_, f) in RESAMPLERS {
            let y = f(&x, 44_100, 16_000);
            let folded = (alias % 16_000.0).abs();
            row += &format!(
                " {:.1} |",
                db(tone_amplitude(middle(&y, 16_000), 16_000, folded) / 0.5)
            );
        }
        println!("{row}");
    }
    {
        let mut row = "| image of 3.5 kHz at 4.5 kHz, 8k->16k (dB) |".to_string();
        let x = sine(3_500.0, 8_000, 2.0, 0.5, 0.0);
        for (_, f) in RESAMPLERS {
            let y = f(&x, 8_000, 16_000);
            row += &format!(
                " {:.1} |",
                db(tone_amplitude(middle(&y, 16_000), 16_000, 4_500.0) / 0.5)
            );
        }
        println!("{row}");
    }
}

fn main() {
    let only = std::env::args().nth(1);
    let run = |part: &str| only.as_deref().is_none_or(|o| o == part);
    if run("decode") {
        decode_speed();
    }
    if run("accept") {
        acceptance();
    }
    if run("resample") {
        resampling();
    }
}
