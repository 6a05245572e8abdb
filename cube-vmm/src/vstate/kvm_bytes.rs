//! Serde adapters for kvm-bindings structs.
//!
//! kvm-bindings serialises its structs as byte strings but, deserialising, silently
//! zero-pads or truncates a string of the wrong length. A state file is untrusted input,
//! so these adapters reject any length but the struct's own.

use std::fmt;
use std::marker::PhantomData;

use serde::de::{self, value::BytesDeserializer, Deserialize, Deserializer, SeqAccess, Visitor};
use serde::{Serialize, Serializer};

/// Serialises as kvm-bindings does (a byte string).
pub(crate) fn serialize<T: Serialize, S: Serializer>(value: &T, s: S) -> Result<S::Ok, S::Error> {
    value.serialize(s)
}

/// Deserialises a byte string of exactly `size_of::<T>()` bytes.
pub(crate) fn deserialize<'de, T, D>(d: D) -> Result<T, D::Error>
where
    T: for<'a> Deserialize<'a>,
    D: Deserializer<'de>,
{
    let bytes = d.deserialize_bytes(ExactBytes::<T>(PhantomData))?;
    T::deserialize(BytesDeserializer::<D::Error>::new(&bytes))
}

/// The same for `Option<T>`.
pub(crate) mod option {
    use super::*;

    /// Serialises `Some` as the byte string, `None` as none.
    pub(crate) fn serialize<T: Serialize, S: Serializer>(
        value: &Option<T>,
        s: S,
    ) -> Result<S::Ok, S::Error> {
        value.serialize(s)
    }

    /// Deserialises an optional byte string of exactly `size_of::<T>()` bytes.
    pub(crate) fn deserialize<'de, T, D>(d: D) -> Result<Option<T>, D::Error>
    where
        T: for<'a> Deserialize<'a>,
        D: Deserializer<'de>,
    {
        #[derive(serde::Deserialize)]
        #[serde(bound = "U: for<'a> Deserialize<'a>")]
        struct Wrapped<U>(#[serde(with = "super")] U);
        Ok(Option::<Wrapped<T>>::deserialize(d)?.map(|Wrapped(v)| v))
    }
}

/// Collects a byte string (binary formats) or byte sequence (JSON) of exactly the
/// size of `T`, never allocating more than that for a lying length prefix.
struct ExactBytes<T>(PhantomData<T>);

impl<'de, T> Visitor<'de> for ExactBytes<T> {
    type Value = Vec<u8>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        write!(f, "{} bytes", std::mem::size_of::<T>())
    }

    fn visit_bytes<E: de::Error>(self, v: &[u8]) -> Result<Self::Value, E> {
        if v.len() != std::mem::size_of::<T>() {
            return Err(E::invalid_length(v.len(), &self));
        }
        Ok(v.to_vec())
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let want = std::mem::size_of::<T>();
        let mut bytes = Vec::with_capacity(want);
        while let Some(b) = seq.next_element::<u8>()? {
            if bytes.len() == want {
                return Err(de::Error::invalid_length(want + 1, &self));
            }
            bytes.push(b);
        }
        if bytes.len() != want {
            return Err(de::Error::invalid_length(bytes.len(), &self));
        }
        Ok(bytes)
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn kvm_bytes_rejects_wrong_lengths() {
        #[derive(serde::Serialize, serde::Deserialize, Debug, PartialEq)]
        struct Holder {
            #[serde(with = "super")]
            regs: kvm_bindings::kvm_regs,
        }
        let regs = kvm_bindings::kvm_regs {
            rax: 7,
            rip: 0x1000,
            ..Default::default()
        };
        let bytes = postcard::to_allocvec(&Holder { regs }).unwrap();
        assert_eq!(postcard::from_bytes::<Holder>(&bytes).unwrap().regs, regs);
        let json = serde_json::to_string(&Holder { regs }).unwrap();
        assert_eq!(serde_json::from_str::<Holder>(&json).unwrap().regs, regs);

        // A byte string one byte short: kvm-bindings alone would zero-pad it.
        let size = std::mem::size_of::<kvm_bindings::kvm_regs>();
        let mut short = postcard::to_allocvec(&vec![0u8; size - 1]).unwrap();
        assert!(postcard::from_bytes::<Holder>(&short).is_err());
        short = postcard::to_allocvec(&vec![0u8; size + 1]).unwrap();
        assert!(postcard::from_bytes::<Holder>(&short).is_err());
        let long_json = format!("{{\"regs\":{:?}}}", vec![0u8; size + 1]);
        assert!(serde_json::from_str::<Holder>(&long_json).is_err());
    }
}
