local function rank(s)
  if not s then return 0 end
  if s == 'queued' then return 1 end
  if s == 'running' then return 2 end
  return 3
end
local current = redis.call('HGET', KEYS[1], 'status')
local cur, new = rank(current), rank(ARGV[1])
if cur == 3 or new < cur or (new == 1 and cur == 1) then
  return 0
end
redis.call('HSET', KEYS[1], 'status', ARGV[1], 'result', ARGV[2])
redis.call('EXPIRE', KEYS[1], tonumber(ARGV[3]))
if new == 3 and KEYS[2] then
  redis.call('RPUSH', KEYS[2], ARGV[1])
  redis.call('EXPIRE', KEYS[2], tonumber(ARGV[3]))
end
if new == 3 and KEYS[3] then
  redis.call('XADD', KEYS[3], 'MAXLEN', '~', '10000', '*', 'type', 'end', 'attempt', ARGV[4] or '0', 'status', ARGV[1])
  redis.call('EXPIRE', KEYS[3], tonumber(ARGV[3]))
end
return 1
